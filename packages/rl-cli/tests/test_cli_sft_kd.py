"""Knowledge distillation in ``rl sft`` (``--teacher_pretrain``): the loss against a hand computation, the refusals,
OpenRLHF's ``train_kd`` names, packed rows, and (slow) KD working, not only running.

The task: ``Say the letter X: `` answered by 8 letters, each X with probability 0.7 and else X's neighbour in the
alphabet (a noisy task, so the teacher's next-token distributions are soft: what KD passes on beyond the data's
one-hot tokens). The teacher: a tiny model trained by ``rl sft`` on 256 rows. Two students from the same random
init, the same seed, steps and settings, trained on another 16 rows: plain SFT, and SFT with the teacher
(``--teacher_pretrain``, forward KL, ``--kd_coef 0.9``). Measured: KL(teacher || student) over the response tokens of
64 held-out rows (numbers in :func:`test_kd_student_ends_closer_to_the_teacher_than_plain_sft`).
"""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch

from rl_cli.main import main

LETTERS = "abcdefgh"


def rows(n: int, seed: int) -> list[dict]:
    rng, out = random.Random(seed), []
    for _ in range(n):
        i = rng.randrange(len(LETTERS))
        c, near = LETTERS[i], LETTERS[(i + 1) % len(LETTERS)]
        out.append({"prompt": f"Say the letter {c}: ", "response": "".join(c if rng.random() < 0.7 else near
                                                                          for _ in range(8))})
    return out


def write(path, rs) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rs))
    return str(path)


def sft_argv(model, data, *extra) -> list[str]:
    return ["sft", "--pretrain", str(model), "--dataset", str(data), "--input_key", "prompt", "--output_key",
            "response", "--max_len", "64", "--zero_stage", "0", "--bf16", "false", "--seed", "0", *extra]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from rl_rollout.testing import make_tiny_model

    root = tmp_path_factory.mktemp("sft-kd")
    student = make_tiny_model(root / "student", seed=0)
    base = make_tiny_model(root / "teacher0", seed=1)
    data = {name: write(root / f"{name}.jsonl", rows(n, seed))
            for name, n, seed in (("teacher", 256, 1), ("student", 16, 2), ("heldout", 64, 3))}
    teacher = root / "teacher"
    assert main(sft_argv(base, data["teacher"], "--save_path", str(teacher), "--max_epochs", "3",
                         "--learning_rate", "3e-3", "--train_batch_size", "32", "--micro_train_batch_size", "32")) == 0
    return root, student, teacher, data


# ----- the loss, by hand -----------------------------------------------------------------------------------------


def test_the_mixed_loss_matches_a_hand_computation_in_float64():
    from rl_core.model_rows import align_to_tokens
    from rl_core.trainers.sft_kd import kd_loss, token_divergence

    torch.manual_seed(0)
    B, T, V, coef = 2, 4, 5, 0.3
    s_logits = torch.randn(B, T, V, dtype=torch.float64)
    t_logits = torch.randn(B, T, V, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T))
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.float64)
    # the log-probs as rl_core.models.Actor places them: lp[:, t] = log p(ids[t] | ids[<t]), from logits[:, t - 1]
    lp = torch.zeros(B, T, dtype=torch.float64)
    lp[:, 1:] = torch.log_softmax(s_logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    inputs = {"input_ids": ids, "attention_mask": torch.ones(B, T)}
    div = align_to_tokens(token_divergence(s_logits, t_logits, "forward_kl"), inputs)
    got = kd_loss(lp, div, mask, coef)

    def softmax(xs):
        m = max(xs)
        z = sum(math.exp(x - m) for x in xs)
        return [math.exp(x - m) / z for x in xs]

    nlls, kls = [], []
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                q = softmax(s_logits[b, t - 1].tolist())  # the student's distribution of token t
                p = softmax(t_logits[b, t - 1].tolist())  # the teacher's
                nlls.append(-math.log(q[int(ids[b, t])]))
                kls.append(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)))
    nll, kl = sum(nlls) / len(nlls), sum(kls) / len(kls)
    assert got.nll.item() == pytest.approx(nll, abs=1e-6)
    assert got.kd.item() == pytest.approx(kl, abs=1e-6)
    assert got.loss.item() == pytest.approx((1 - coef) * nll + coef * kl, abs=1e-6)
    for name, beta in (("reverse_kl", 0.5), ("jsd", 0.5)):
        d = token_divergence(s_logits, t_logits, name, beta)
        assert d.shape == (B, T) and bool((d >= 0).all())
    assert torch.equal(token_divergence(s_logits, t_logits, "reverse_kl"), token_divergence(t_logits, s_logits,
                                                                                            "forward_kl"))
    with pytest.raises(ValueError, match=r"kd coef must be in \[0, 1\]"):
        kd_loss(lp, div, mask, 1.5)


# ----- flags: refused, or reaching the config ----------------------------------------------------------------------


def parsed(argv):
    from rl_cli.config import build_parser
    from rl_cli.loading import resolve
    from rl_cli.train import COMMANDS, _groups

    groups = _groups(COMMANDS["sft"])
    parser, flags = build_parser("rl sft", "", groups)
    return resolve(groups, parser.parse_args(argv), flags)["train"]


def test_openrlhf_train_kd_names_reach_the_kd_node():
    base = ["--pretrain", "/nonexistent/m", "--dataset", "/nonexistent/d.jsonl"]
    assert parsed(base).kd is None
    ours = parsed(base + ["--teacher_pretrain", "/t", "--kd_coef", "0.25"]).kd
    theirs = parsed(base + ["--teacher_model", "/t", "--kd_coef", "0.25"]).kd
    dotted = parsed(base + ["--train.kd.teacher_pretrain", "/t", "--train.kd.coef", "0.25"]).kd
    assert ours == theirs == dotted and ours.teacher_pretrain == "/t" and ours.coef == 0.25
    assert ours.divergence == "forward_kl" and parsed(base + ["--teacher_model", "/t"]).kd.coef == 0.4  # OpenRLHF's
    jsd = parsed(base + ["--teacher_model", "/t", "--kd_divergence", "jsd", "--kd_jsd_beta", "0.2"]).kd
    assert (jsd.divergence, jsd.beta) == ("jsd", 0.2)


@pytest.mark.parametrize(("argv", "says"), [
    (["--kd_coef", "0.5"], "add --teacher_pretrain FOLDER (the teacher), or drop them"),
    (["--kd_divergence", "jsd"], "add --teacher_pretrain FOLDER"),
    (["--teacher_pretrain", "T", "--kd_coef", "1.5"], "--kd_coef must be in [0, 1]"),
    (["--teacher_pretrain", "T", "--kd_coef", "-0.1"], "--kd_coef must be in [0, 1]"),
    (["--teacher_pretrain", "T", "--kd_divergence", "tvd"], "--kd_divergence 'tvd': pick one of forward_kl"),
    (["--teacher_pretrain", "T", "--kd_jsd_beta", "0.3"], "is the mixture weight of --kd_divergence jsd"),
    (["--teacher_pretrain", "T", "--kd_divergence", "jsd", "--kd_jsd_beta", "1"], "--kd_jsd_beta must be in (0, 1)"),
    (["--teacher_pretrain", "T", "--teacher_offload"], "--teacher_offload: a frozen model's parameters go to the CPU"),
    (["--teacher_pretrain", "T", "--fused_lm_head"], "which --fused_lm_head never holds whole"),
    (["--teacher_pretrain", "T", "--ring_attn_size", "2"], "use --ring_attn_size 1"),
])
def test_kd_settings_are_refused_before_any_model_loads(argv, says, tmp_path, capsys):
    from rl_rollout.testing import make_tiny_model

    model = make_tiny_model(tmp_path / "m")
    data = write(tmp_path / "d.jsonl", rows(8, 0))
    teacher = str(model)
    argv = [teacher if a == "T" else a for a in argv]
    with pytest.raises(SystemExit) as e:
        main(sft_argv(model, data, "--save_path", str(tmp_path / "out"), *argv))
    assert e.value.code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path, capsys):
    from rl_rollout.testing import make_tiny_model, make_tokenizer

    student = make_tiny_model(tmp_path / "student")
    other = tmp_path / "other"
    shutil.copytree(make_tiny_model(tmp_path / "t"), other)
    make_tokenizer(128, extra_special=("<tool>",)).save_pretrained(other)
    data = write(tmp_path / "d.jsonl", rows(8, 0))
    with pytest.raises(SystemExit) as e:
        main(sft_argv(student, data, "--teacher_model", str(other), "--run_dir", str(tmp_path / "run")))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--teacher_pretrain" in err and str(other) in err and str(student) in err
    assert "tokens only the teacher has: ['<tool>']" in err and "knowledge distillation" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def metrics(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"train/' in x]


def test_packed_rows_zero3_and_lora_give_the_plain_runs_first_step(tmp_path):
    """The teacher scores the same packed row as the student (the divergence lands on the same tokens), is
    partitioned under ZeRO-3 (and offloaded with --teacher_offload), and stays whole beside a LoRA student: step 1's
    metrics (before any update) agree with the padded ZeRO-0 run's."""
    from rl_rollout.testing import make_tiny_model

    student, teacher = make_tiny_model(tmp_path / "s", seed=0), make_tiny_model(tmp_path / "t", seed=1)
    data = write(tmp_path / "d.jsonl", rows(16, 0))
    got = {}
    for name, extra in (("plain", []), ("packed", ["--packing_samples", "true"]), ("lora", ["--lora_rank", "4"]),
                        ("zero3", ["--zero_stage", "3", "--teacher_offload"])):
        run = tmp_path / f"run-{name}"
        assert main(sft_argv(student, data, "--teacher_pretrain", str(teacher), "--kd_divergence", "jsd",
                             "--train_batch_size", "8", "--micro_train_batch_size", "4", "--max_steps", "1",
                             "--run_dir", str(run), *extra)) == 0
        got[name] = metrics(run)[0]
    for name in ("packed", "lora", "zero3"):
        for key in ("train/loss", "train/nll", "train/kd/loss", "train/kd/forward_kl"):
            assert got[name][key] == pytest.approx(got["plain"][key], rel=1e-4), (name, key)
    assert got["plain"]["train/kd/loss"] > 0 and got["plain"]["train/kd/forward_kl"] > got["plain"]["train/kd/loss"]


# ----- KD working ---------------------------------------------------------------------------------------------------


def kl_to_teacher(student, teacher, data) -> float:
    """Mean KL(teacher || student) over the response tokens of ``data``'s rows (padded rows, fp32)."""
    from rl_algos import forward_kl
    from rl_core.data import DataConfig, SFTDataset, load_rows, pad_collate
    from rl_core.model_rows import align_to_tokens
    from rl_core.models import Actor
    from rl_core.preflight import load_tokenizer

    tok = load_tokenizer(str(student))
    ds = SFTDataset(load_rows(data), tok, DataConfig(input_key="prompt", output_key="response", max_len=64))
    b = pad_collate([ds[i] for i in range(len(ds))], tok.pad_token_id)
    inputs = {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
    with torch.no_grad():
        s = Actor.from_pretrained(str(student)).eval()(**inputs, return_logits=True).logits
        t = Actor.from_pretrained(str(teacher)).eval()(**inputs, return_logits=True).logits
    kl = align_to_tokens(forward_kl(s, t), inputs)
    m = b["loss_mask"].float()
    return float((kl * m).sum() / m.sum())


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_kd_student_ends_closer_to_the_teacher_than_plain_sft(task):
    """Measured on the 2-core machine (seed 0, 16 epochs of 16 rows, 16 steps): KL(teacher || student) over the
    response tokens of the 64 held-out rows: untrained student 2.673, plain SFT 0.911 (it fits the 16 rows' noisy
    letters: train NLL 4.41 -> 1.27), KD (forward KL, kd_coef 0.9) 0.549. 35 s (the teacher 16 s, both students
    and the measurement 19 s; 112 s on the machine loaded by other runs)."""
    root, student, teacher, data = task
    common = ["--max_epochs", "16", "--learning_rate", "3e-3", "--train_batch_size", "16", "--micro_train_batch_size",
              "16", "--lr_warmup_ratio", "0"]
    out = {}
    for name, extra in (("plain", []), ("kd", ["--teacher_pretrain", str(teacher), "--kd_coef", "0.9"])):
        run, saved = root / f"run-{name}", root / f"student-{name}"
        assert main(sft_argv(student, data["student"], *common, *extra, "--run_dir", str(run), "--save_path",
                             str(saved))) == 0
        out[name] = (kl_to_teacher(saved, teacher, data["heldout"]), metrics(run))
    kl_plain, plain_rows = out["plain"]
    kl_kd, kd_rows = out["kd"]
    kl_init = kl_to_teacher(student, teacher, data["heldout"])
    print(f"KL(teacher || student) on held-out rows: untrained {kl_init:.3f}, plain SFT {kl_plain:.3f}, "
          f"KD {kl_kd:.3f}")
    assert len(plain_rows) == len(kd_rows) == 16
    assert all({"train/nll", "train/kd/loss", "train/kd/forward_kl"} <= set(r) for r in kd_rows)
    assert not any("train/kd/loss" in r for r in plain_rows)
    assert kd_rows[-1]["train/kd/loss"] < 0.5 * kd_rows[0]["train/kd/loss"]  # the training divergence falls
    assert kl_kd < kl_init and kl_plain < kl_init
    assert kl_kd < 0.75 * kl_plain, (kl_kd, kl_plain)
