"""Weights in huge pages (treadle/kernels/hugepages.py): the copies hold the same values, start
on the boundaries promised, are backed by 2 MiB pages where the kernel allows them, and are
given back when the last tensor on them goes."""

import gc

import pytest
import torch

from treadle.kernels import hugepages


def _rss_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) >> 10


def _mapping_at(address: int) -> tuple[int, int, int] | None:
    """(start, end, AnonHugePages bytes) of the mapping that holds `address`
    (/proc/self/smaps), or None where nothing is mapped."""
    found = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                if found is not None:
                    break
                start, end = (int(x, 16) for x in head.split("-"))
                if start <= address < end:
                    found = (start, end, 0)
            elif found is not None and head == "AnonHugePages:":
                found = (found[0], found[1], int(line.split()[1]) * 1024)
    return found


def _huge_bytes_of_mapping_at(address: int) -> int:
    """AnonHugePages of the mapping that holds `address`."""
    mapping = _mapping_at(address)
    return mapping[2] if mapping is not None else 0


def test_gather_copies_values_once_and_aligns() -> None:
    a, b = torch.randn(300, 576), torch.randn(7, 5).bfloat16()
    ga, none, gb, ga_again = hugepages.gather([a, None, b, a])
    assert none is None and ga_again is ga   # a tensor given twice is copied once
    assert torch.equal(ga, a) and torch.equal(gb, b)
    assert ga.is_contiguous() and gb.is_contiguous()
    assert ga.data_ptr() != a.data_ptr()
    assert ga.data_ptr() % hugepages.ALIGN == 0 and gb.data_ptr() % hugepages.ALIGN == 0
    if hugepages.enabled():
        assert ga.data_ptr() % hugepages.HUGE_PAGE == 0   # the region's start


def test_carve_lays_tensors_side_by_side() -> None:
    x, y = hugepages.carve([((3, 5), torch.float32), ((4,), torch.bfloat16)])
    assert x.shape == (3, 5) and x.dtype == torch.float32 and y.shape == (4,) and y.dtype == torch.bfloat16
    assert y.data_ptr() - x.data_ptr() == hugepages.ALIGN   # 60 bytes, rounded up to a line
    x.fill_(1.0)
    y.fill_(2.0)
    assert x.sum().item() == 15 and y.sum().item() == 8
    assert hugepages.region(0).numel() == 0


def test_region_is_backed_by_huge_pages_and_given_back() -> None:
    gc.collect()
    before_rss = _rss_mib()
    memory = hugepages.region(64 << 20).fill_(1)
    start, end, huge = _mapping_at(memory.data_ptr())
    if hugepages.enabled():   # THP at "madvise" or "always"
        assert huge >= 60 << 20
    view = memory[1 << 20:]
    del memory
    gc.collect()
    assert view[0].item() == 1   # a view keeps the mapping
    assert _rss_mib() - before_rss >= 60
    del view
    gc.collect()
    assert _rss_mib() - before_rss < 16
    # The region's own mapping is gone (the process's other memory may gain huge pages
    # meanwhile, so its total is no measure).
    after = _mapping_at(start)
    assert after is None or after[:2] != (start, end)


def test_switched_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TREADLE_HUGEPAGES", "0")
    assert not hugepages.enabled()
    memory = hugepages.region(4 << 20)
    assert memory.numel() == 4 << 20   # ordinary memory, same contract


def test_engine_places_parameters_tile_copies_and_bf16_kv_cache(smollm2_path) -> None:
    from treadle import LLM, SamplingParams
    llm = LLM(smollm2_path, dtype="bfloat16", max_model_len=512, enable_prefix_caching=False,
              kv_cache_memory_bytes=64 << 20)
    try:
        runner = llm.engine.core.executor.worker.runner
        caches = runner.kv_caches
        # One region, layer after layer, zeroed (the torch path reads slots past a sequence's end).
        layer_bytes = caches[0].numel() * caches[0].element_size()
        assert all(c.dtype == torch.bfloat16 and not c.any() for c in caches)
        assert all(b.data_ptr() - a.data_ptr() == -(-layer_bytes // hugepages.ALIGN) * hugepages.ALIGN
                   for a, b in zip(caches, caches[1:]))
        if hugepages.enabled():
            assert caches[0].data_ptr() % hugepages.HUGE_PAGE == 0
            assert _huge_bytes_of_mapping_at(caches[0].data_ptr()) >= len(caches) * layer_bytes - (4 << 20)
        out = llm.generate([{"prompt_token_ids": list(range(100, 140))}],
                           SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4 and any(c.any() for c in caches)
        model = runner.model
        params = list(model.parameters())
        # One region: the parameters lie side by side, each on a cache line.
        starts = sorted(p.data_ptr() for p in params)
        nbytes = sum(p.numel() * p.element_size() for p in params)
        assert all(s % hugepages.ALIGN == 0 for s in starts)
        assert starts[-1] - starts[0] < nbytes + hugepages.ALIGN * len(params)
        tiles = [m.tiles for m in model.modules() if getattr(m, "tiles", None) is not None]
        for t in tiles:   # only on a CPU with AMX; elsewhere there are none to place
            assert t.data_ptr() % hugepages.ALIGN == 0
    finally:
        llm.shutdown()
