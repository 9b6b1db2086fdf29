import pytest

from npformer.kernels.cpu import dropout as cpu_dropout


@pytest.fixture(autouse=True)
def small_masks_streamed(monkeypatch):
    """The dropout fast paths take any even size here, so their parity cases may be small (in
    production masks under MIN_STREAM_ELEMENTS take the reference: test_small_masks_take_the_reference)."""
    monkeypatch.setattr(cpu_dropout, "MIN_STREAM_ELEMENTS", 2)
