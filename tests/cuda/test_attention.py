"""The packed-native attention kernels in the single-GPU lane (``pytest -m cuda``; deselected by
default): packed rows (4 a micro-batch) trained with flex_attention, and with each flash kernel
installed, give sdpa's dense-mask losses at bf16-mixed."""

import importlib.util

import pytest

from components.models.attention import FLASH_PACKAGES
from tests.cuda.test_single_gpu import recipe, relative_gaps

pytestmark = pytest.mark.cuda
PACKED = ["train.packing=true", "train.seq_len=256", "train.precision=bf16-mixed"]
INSTALLED = [k for k, (module, _) in FLASH_PACKAGES.items() if importlib.util.find_spec(module)]
KERNELS = ["flex_attention", *INSTALLED]


@pytest.fixture(scope="module")
def sdpa(tmp_path_factory) -> list[dict]:
    return recipe(tmp_path_factory.mktemp("sdpa"), *PACKED)


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_packed_native_kernel_trains_packed_rows_as_sdpa_does(tmp_path, sdpa, kernel):
    records = recipe(tmp_path, *PACKED, f"model.attn_implementation={kernel}")
    assert max(relative_gaps(records, sdpa)) < 1e-2  # bf16 rounding, kernel by kernel
