"""The pieces of gathers at uneven batches, in one process: the shape check, the padding and the cut."""

from __future__ import annotations

import pytest
import torch

from lightning_aesgd.user_collectives import (
    StepCollectives,
    UnevenGatherError,
    check_same_shapes,
    padded_rows,
    rows_in_rank_order,
)


def test_equal_shapes_pass_and_unequal_ones_name_every_replicas_shape_and_the_fix():
    check_same_shapes([[12, 3], [12, 3], [12, 3]])
    with pytest.raises(UnevenGatherError, match=r"0: \[12, 3\], 1: \[4, 3\].*HINT: .*all_gather_rows"):
        check_same_shapes([[12, 3], [4, 3]])


def test_padding_appends_zero_rows_and_gradients_reach_only_the_original_rows():
    rows = torch.ones(2, 3, requires_grad=True)
    padded = padded_rows(rows, 5)
    assert padded.shape == (5, 3)
    assert padded[2:].abs().sum() == 0
    (padded * torch.arange(5.0).unsqueeze(1)).sum().backward()
    assert rows.grad.tolist() == [[0.0] * 3, [1.0] * 3]
    assert padded_rows(rows, 2) is rows


def test_gathered_padded_rows_are_cut_back_to_each_replicas_own():
    own = [torch.arange(3), torch.arange(10, 11), torch.arange(20, 22)]
    gathered = torch.stack([padded_rows(rows, 3) for rows in own])
    assert rows_in_rank_order(gathered, [3, 1, 2]).tolist() == [0, 1, 2, 10, 20, 21]


def test_only_collectives_inside_a_training_step_count_and_each_once():
    collectives = StepCollectives()
    collectives.note("barrier")  # outside a step: Lightning's own, e.g. before a checkpoint
    assert collectives.reason() is None
    collectives.watching = True
    for name in ("all_gather", "reduce", "all_gather"):
        collectives.note(name)
    assert collectives.reason() == (
        "the training step calls the strategy's all_gather, reduce, which every replica must join"
    )
