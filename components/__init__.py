"""shardtune's building blocks, one package per concern.

torchao (``train.precision=fp8``) is imported by our code only where fp8 needs it, but transformers
imports it whenever it is installed, at ``transformers.modeling_utils`` (its torchao quantizer,
``transformers/quantizers/quantizer_torchao.py``), in every run of any precision. That import logs
two kinds of line on every rank: torchao's, that its CUDA kernels' libraries (``torchao/_C*.so``)
did not load on a CPU build of torch (fp8 training needs none: it calls ``torch._scaled_mm``); and
torch's, that an Enum torchao registers as a pytree constant needs no registration. This package is
imported before transformers is, so the filters below drop exactly those lines: the first from
torchao's own logger, the second only for an Enum defined in torchao. Anything else still shows.
"""

import logging


class _TorchaoImportNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.name == "torchao":
            return not (message.startswith("Failed to load") and "torchao/_C" in message)
        cls = record.args[0] if isinstance(record.args, tuple) and record.args else None
        torchao_enum = getattr(cls, "__module__", "").startswith("torchao")
        return not (torchao_enum and "is an Enum subclass and is now natively" in message)


for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).addFilter(_TorchaoImportNoise())
