"""Third-party notices that say nothing to our users, dropped before the library that prints them loads.

DeepSpeed logs "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
on import on every machine without CUDA, before any line of ours. The run's banner names the device and ``rl
doctor`` names a GPU torch cannot see, so that one message is dropped; DeepSpeed's other messages still show.
Imported first by ``rl_core/__init__.py``.
"""

import logging

CPU_NOTICE = "Setting accelerator to CPU"


def _not_cpu_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(CPU_NOTICE)


logging.getLogger("DeepSpeed").addFilter(_not_cpu_notice)
