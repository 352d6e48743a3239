"""The `hf` engine's KV cache layer that grows into spare capacity (`hf_batch.GrowingLayer`)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from services.generation.hf_backend import HFBackend
from services.generation.hf_batch import GrowingLayer, left_pad, new_cache
from services.positions import position_ids_for


def decode(backend: HFBackend, cache: DynamicCache, steps: int) -> list[torch.Tensor]:
    """Greedy logits of a left-padded batch of three prompts: the prefill, then `steps` tokens."""
    model = backend.model
    # The forward's cache argument under this transformers' name (`past_key_values` before 5.2x).
    passing = {backend._cache_arg: cache}
    rows = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    input_ids, mask = left_pad(rows, 0, torch.device("cpu"))
    out: list[torch.Tensor] = []
    with torch.inference_mode():
        logits = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids_for(mask),
            **passing,
            use_cache=True,
        ).logits[:, -1]
        out.append(logits)
        for _ in range(steps):
            mask = torch.nn.functional.pad(mask, (0, 1), value=1)
            positions = mask.sum(dim=-1, keepdim=True) - 1
            logits = model(
                input_ids=logits.argmax(dim=-1, keepdim=True),
                attention_mask=mask,
                position_ids=positions,
                **passing,
                use_cache=True,
            ).logits[:, -1]
            out.append(logits)
    return out


def test_a_growing_cache_gives_the_logits_of_transformers_cache(hf_backend: HFBackend) -> None:
    config = hf_backend.model.config
    growing = new_cache(config)
    assert all(type(layer) is GrowingLayer for layer in growing.layers)
    expected = decode(hf_backend, DynamicCache(config=config), 70)
    got = decode(hf_backend, growing, 70)
    for step, (mine, theirs) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    layer = growing.layers[0]
    assert isinstance(layer, GrowingLayer) and layer.keys is not None
    assert layer.keys.shape[-2] == 5 + 70
    assert layer.capacity() > layer.keys.shape[-2]  # spare columns are kept, not trimmed


def states(rows: int, columns: int, fill: float) -> torch.Tensor:
    return torch.full((rows, 2, columns, 4), fill)


def test_appends_reallocate_geometrically_and_write_in_place() -> None:
    layer = GrowingLayer()
    layer.update(states(3, 5, 0.0), states(3, 5, 0.0))
    reallocations = 0
    for column in range(1, 501):
        before = layer._buffers["keys"]
        assert before is not None
        keys, values = layer.update(states(3, 1, float(column)), states(3, 1, -float(column)))
        after = layer._buffers["keys"]
        assert after is not None
        if after.data_ptr() != before.data_ptr():
            reallocations += 1
        assert keys.shape == values.shape == (3, 2, 5 + column, 4)
    # 505 columns from 5: about log_1.5(505 / 37) reallocations, not one per token.
    assert reallocations <= 8
    assert layer.keys is not None and layer.values is not None
    assert torch.equal(layer.keys[:, :, 5:, 0], torch.arange(1.0, 501.0).expand(3, 2, 500))
    assert torch.equal(layer.values[:, :, 5:, 0], -torch.arange(1.0, 501.0).expand(3, 2, 500))


def test_assigning_keys_leaves_values_as_they_were() -> None:
    layer = GrowingLayer()
    layer.update(states(2, 6, 1.0), states(2, 6, 2.0))
    # What `RunningBatch.select` does: cut columns off the keys, then off the values.
    layer.keys = layer.keys[..., 2:, :] if layer.keys is not None else None
    assert layer.values is not None and layer.values.shape[-2] == 6
    layer.values = layer.values[..., 2:, :]
    assert layer.keys is not None and layer.keys.shape[-2] == layer.values.shape[-2] == 4
    keys, values = layer.update(states(2, 1, 3.0), states(2, 1, 4.0))
    assert keys[0, 0, :, 0].tolist() == [1.0] * 4 + [3.0]
    assert values[0, 0, :, 0].tolist() == [2.0] * 4 + [4.0]


def test_selecting_rows_keeps_them_and_the_spare_capacity() -> None:
    layer = GrowingLayer()
    rows = torch.arange(4.0)[:, None, None, None].expand(4, 2, 3, 4).clone()
    layer.update(rows, -rows)
    capacity = layer.capacity()
    layer.batch_select_indices(torch.tensor([3, 1]))
    assert layer.capacity() == capacity
    assert layer.keys is not None and layer.values is not None
    assert layer.keys[:, 0, 0, 0].tolist() == [3.0, 1.0]
    assert layer.values[:, 0, 0, 0].tolist() == [-3.0, -1.0]
