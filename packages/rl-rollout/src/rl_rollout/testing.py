"""Tiny local models for tests, demos and benchmarks: no hub, no download.

:func:`make_tiny_model` writes a character-level tokenizer (WordLevel over printable
ASCII plus special tokens, with a chat template) and a random-init Llama causal LM
to a folder that transformers, vLLM (CPU build) and DeepSpeed all load (``num_experts``: a
Mixtral mixture-of-experts instead, for the MoE load-balancing loss). head_dim
is 64 because vLLM's CPU attention rejects 16 (ENVIRONMENT.md). The architecture
is Llama, not Qwen2: transformers 5 replaces the tokenizer of a ``qwen2`` config
with its own byte-level pre-tokenizer (its list of hub configs with a wrong
tokenizer class), which would drop the character tokenizer's newline.

:func:`make_tiny_vlm` writes a random tiny LLaVA (CLIP vision tower, Llama text model) with its processor, and
:func:`write_test_images` a few small PNGs, for vision-language tests. LLaVA, not Qwen2-VL: every Qwen-VL
processor has a video processor, which transformers 5 builds only with torchvision (not in these venvs).

The process helpers (:func:`missing_modules`, :func:`run_ranks`, :func:`kill_started_with`) are
:mod:`rl_rollout.testing_procs`, the weight helpers :mod:`rl_rollout.testing_weights`; both re-exported here.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from rl_rollout.testing_procs import (  # noqa: F401 - re-exported: tests import them from here
    kill_started_with,
    missing_modules,
    run_ranks,
)
from rl_rollout.testing_weights import (  # noqa: F401 - re-exported: tests import them from here
    greedy_reference,
    ipc_sender_process,
    ipc_trainer_process,
    peaked_weights,
)
from rl_rollout.vllm_worker import with_tower_level

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Why the vLLM tests written for vLLM's CPU build skip on a CUDA machine (issue 16 item 5), measured on an H200 with
# vLLM 0.26.0 (docs/performance.md): they compare vLLM with transformers exactly (fp32 log-probs within 1e-4, greedy
# tokens equal), two engines at vLLM's default memory share do not fit one GPU, and on the GPU vLLM's fp32 log-probs
# differ from transformers' by up to 1.5e-2, one greedy continuation diverging after 8 tokens. Agreement on the GPU is
# tested with a bf16 tolerance of its own by rl-cli's test_cli_vllm_gpu.py (and the IPC path by
# test_rollout_vllm_ipc.py).
VLLM_CPU_TESTS_ON_CUDA = (
    "written for vLLM's CPU build (exact fp32 agreement with transformers, two engines at a time); on a CUDA "
    "machine vLLM's GPU kernels differ from transformers' by up to 1.5e-2 in fp32 and greedy tokens diverge, so "
    "the GPU's agreement is tested by packages/rl-cli/tests/test_cli_vllm_gpu.py (bf16 and fp32 tolerances of its "
    "own) and test_rollout_vllm_ipc.py"
)


def make_tokenizer(vocab_size: int = 128, extra_special: tuple[str, ...] = ()):
    """A ``PreTrainedTokenizerFast`` that maps each printable ASCII char (and ``\\n``) to one id
    (``extra_special``: more special tokens, each one id, after the standard ones)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    specials_all = SPECIAL_TOKENS + list(extra_special)
    vocab = {t: i for i, t in enumerate(specials_all + chars)}
    if vocab_size < len(vocab):
        raise ValueError(f"vocab_size must be >= {len(vocab)} (specials + printable ASCII), got {vocab_size}")
    while len(vocab) < vocab_size:
        vocab[f"<extra_{len(vocab)}>"] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    specials = "|".join(t.replace("|", r"\|") for t in specials_all)
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(f"{specials}|[\\s\\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        bos_token=None,
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>", *extra_special],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tiny_model(
    path: str | os.PathLike,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    vocab_size: int = 128,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    dtype: str = "float32",
    tie_word_embeddings: bool = True,
    peaked: bool = False,
    num_experts: int = 0,
) -> Path:
    """Save a random tiny Llama and its tokenizer to ``path``; returns the path.

    ``num_experts > 0``: a Mixtral (sparse MoE, 2 experts per token) with that many experts per layer
    instead, each expert of ``intermediate_size``.

    ``peaked=True`` stores :func:`peaked_weights` (seeded by ``seed``) instead of
    the default init: use it where greedy outputs of two engines are compared.
    Idempotent: if ``path/config.json`` exists the folder is reused as is.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(vocab_size)
    config_cls, model_cls = (MixtralConfig, MixtralForCausalLM) if num_experts else (LlamaConfig, LlamaForCausalLM)
    moe: dict[str, Any] = (
        {"num_local_experts": num_experts, "num_experts_per_tok": min(2, num_experts)} if num_experts else {}
    )
    cfg = config_cls(
        **moe,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = model_cls(cfg).to(getattr(torch, dtype))
    if peaked:
        model.load_state_dict(peaked_weights(model, seed=seed))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


IMAGE_TOKEN = "<image>"
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_vlm(
    path: str | os.PathLike,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 128,
    image_size: int = 28,
    patch_size: int = 14,
    seed: int = 0,
) -> Path:
    """Save a random tiny LLaVA and its processor to ``path``; returns the path (reused if it exists).

    Text model: a Llama of ``hidden_size`` with one attention head of ``hidden_size`` (head_dim 64 by default,
    what vLLM's CPU attention takes), ``num_layers`` layers, the character tokenizer plus ``<image>``. Vision
    tower: one CLIP layer (hidden 32) over ``image_size`` pixels in patches of ``patch_size``: every image is
    resized and cropped to ``image_size`` and becomes ``(image_size / patch_size) ** 2`` tokens (4 by default).
    The chat template renders ``{"type": "image"}`` content parts as ``<image>``. The weights file holds the
    vision tower under the hub checkpoints' names (``vision_tower.vision_model.*``, which transformers 5 reads and
    vLLM's LLaVA needs), not transformers 5's own (``vision_tower.*``, which vLLM 0.26-0.32 cannot load).
    """
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    path = Path(path)
    if (path / "config.json").exists() and (path / "processor_config.json").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(vocab_size, extra_special=(IMAGE_TOKEN,))
    tok.chat_template = VLM_CHAT_TEMPLATE
    images = CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        chat_template=VLM_CHAT_TEMPLATE,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=IMAGE_TOKEN,
    )
    text = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=hidden_size,
        max_position_embeddings=1024,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=True,
    )
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=32,
    )
    cfg = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    processor.save_pretrained(path)
    _hub_tower_names(path / "model.safetensors")
    return path


def _hub_tower_names(file: Path) -> None:
    """Rewrite a LLaVA weights file saved by transformers 5 with its CLIP tower under the hub's names."""
    from safetensors.torch import load_file, save_file

    save_file({with_tower_level(k): v for k, v in load_file(file).items()}, file, metadata={"format": "pt"})


def write_test_images(folder: str | os.PathLike, n: int = 3, size: tuple[int, int] = (40, 30)) -> list[Path]:
    """``n`` small PNGs (``img0.png`` ...), each a different colour with a bar, in ``folder``; their paths."""
    from PIL import Image, ImageDraw

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        img = Image.new("RGB", size, ((70 * i) % 256, (150 + 40 * i) % 256, (220 - 60 * i) % 256))
        ImageDraw.Draw(img).rectangle([i * 4, 2, i * 4 + 8, size[1] - 3], fill=(255, 255, 255))
        out.append(folder / f"img{i}.png")
        img.save(out[-1])
    return out


ENGINE_PLUGIN_MODULE = '''"""A rollout engine plug-in in one module: the transformers engine, announcing every call on stderr."""
import sys

from rl_rollout.engine import EngineSpec
from rl_rollout.hf_engine import HFEngine


class ProbeEngine(HFEngine):
    def generate(self, requests):
        print(f"[hf-probe] generate {len(requests)} requests at version {self.policy_version}", file=sys.stderr)
        return super().generate(requests)

    def update_weights(self, named_tensors, version):
        super().update_weights(named_tensors, version)
        print(f"[hf-probe] weights of version {version}", file=sys.stderr)


def _options(cfg, ctx):
    if ctx.tensor_parallel_size != 1:
        raise ValueError("hf-probe runs on one device")
    return cfg.hf_options(dtype=ctx.dtype, device=ctx.device)


SPEC = EngineSpec("hf-probe", "rl_engine_probe:ProbeEngine", _options, summary="HFEngine that logs its calls")
'''


def write_engine_plugin(root: str | os.PathLike) -> Path:
    """Write an installed-looking rollout engine plug-in under ``root``: the module ``rl_engine_probe``
    (an :class:`~rl_rollout.hf_engine.HFEngine` that prints ``[hf-probe] ...`` on every generate and
    weight update) and the ``dist-info`` declaring its entry point in group ``rl_rollout.engines``, as
    ``pip install`` of a package with ``[project.entry-points."rl_rollout.engines"] hf-probe =
    "rl_engine_probe:SPEC"`` would. Put ``root`` on ``PYTHONPATH`` and ``--rollout_engine hf-probe``
    works. Returns ``root``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "rl_engine_probe.py").write_text(ENGINE_PLUGIN_MODULE)
    info = root / "rl_engine_probe-0.1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rl-engine-probe\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[rl_rollout.engines]\nhf-probe = rl_engine_probe:SPEC\n")
    return root


def cache_as_hub(
    model_dir: str | os.PathLike,
    repo_id: str,
    cache_dir: str | os.PathLike,
    revision: str = "0123456789abcdef0123456789abcdef01234567",
) -> Path:
    """Lay ``model_dir``'s files out as the Hugging Face hub cache holds a downloaded ``repo_id``.

    ``cache_dir/models--org--name/{blobs/<hash>, snapshots/<revision>/<file> -> blob, refs/main}``, the
    layout ``hf download`` writes, so ``--pretrain org/name`` can be tested offline. Returns the snapshot.
    """
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for src in sorted(p for p in Path(model_dir).rglob("*") if p.is_file()):
        digest = hashlib.sha256(src.read_bytes()).hexdigest()
        blob = repo / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(src, blob)
        link = snapshot / src.relative_to(model_dir)
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.exists():
            link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return snapshot


def stand_in_pixtral_names(site: str | os.PathLike | None = None) -> list[str]:
    """vLLM 0.26's llava module imports its Pixtral vision tower at the top, and that imports Pixtral names from
    transformers that 5.17 renamed (``PixtralRotaryEmbedding`` is now ``PixtralVisionRotaryEmbedding``); only a
    Pixtral-HF tower calls them, not this test's CLIP one. Put stand-ins where they are missing (returns their
    names, printed by the test): a vLLM that matches the installed transformers needs none. ``site``: when some
    were missing, also write a ``sitecustomize.py`` there that adds them, and put the folder first on
    ``PYTHONPATH``, so that vLLM's subprocesses (it inspects the model class in one) and ``rl`` commands run as
    subprocesses get them too."""
    # lazy: transformers' Pixtral modules, imported only by the vLLM vision tests on the GPU machine
    import transformers.models.pixtral.image_processing_pixtral as images
    import transformers.models.pixtral.modeling_pixtral as modeling

    def missing(*_a, **_k):
        raise NotImplementedError("a stand-in for a Pixtral name this transformers lacks (test only)")

    added = []
    for module, name in (
        (modeling, "PixtralRotaryEmbedding"),
        (modeling, "apply_rotary_pos_emb"),
        (modeling, "position_ids_in_meshgrid"),
        (images, "_num_image_tokens"),
    ):
        if not hasattr(module, name):
            setattr(
                module,
                name,
                getattr(modeling, "PixtralVisionRotaryEmbedding", missing)
                if name == "PixtralRotaryEmbedding"
                else missing,
            )
            added.append(f"{module.__name__}.{name}")
    if added and site is not None:
        # lazy: inspect, only to copy this function's source into the sitecustomize
        import inspect

        folder = Path(site)
        folder.mkdir(parents=True, exist_ok=True)
        source = inspect.getsource(stand_in_pixtral_names)
        (folder / "sitecustomize.py").write_text(
            f"import os\nfrom pathlib import Path\n\n\n{source}\n\nstand_in_pixtral_names()\n"
        )
        os.environ["PYTHONPATH"] = f"{folder}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return added
