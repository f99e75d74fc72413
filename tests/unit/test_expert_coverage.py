"""Coverage errors of a stacked expert tensor name the experts (`plans/checkpoint/expert_coverage.py`);
the tiling check's and the planner's messages that carry the note are in test_reshard_planner.py.
Expected messages are literal, worked by hand."""
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.checkpoint.expert_coverage import _spans, expert_note

GATE_UP = "layers.1.feed_forward.experts.gate_up.weight"
SHAPE = (8, 4, 2)  # 8 experts, each a 4 x 2 block (8 elements, 32 bytes in float32)


def piece(first, count, rows=(0, 4), name=GATE_UP, shape=SHAPE):
    """Experts first .. first+count-1, rows rows[0] .. rows[0]+rows[1]-1 of dim 1, all of dim 2."""
    offsets, sizes = (first, rows[0], 0), (count, rows[1], shape[2])
    start = 1000 * first + 10 * rows[0]
    return Chunk(name, "param", "float32", shape, offsets, sizes, "f", start, start + count * rows[1] * shape[2] * 4,
                 "crc32:00000000")


def test_a_tensor_that_is_not_a_stacked_expert_tensor_gets_no_note():
    assert expert_note("layers.1.feed_forward.gate_up.weight", SHAPE, [piece(0, 4)]) == ""
    assert expert_note("layers.1.feed_forward.experts.bias", (8,), []) == ""  # one dim: no per-expert rows
    assert expert_note(GATE_UP, SHAPE, [piece(0, 4), piece(4, 4)]) == ""  # every expert whole, once


def test_a_two_dimensional_expert_tensor_is_counted_by_rows():
    bias = "layers.0.feed_forward.experts.down.bias"  # 4 experts of 3 elements each
    chunk = Chunk(bias, "param", "float32", (4, 3), (0, 0), (2, 3), "f", 0, 24, "crc32:00000000")
    assert expert_note(bias, (4, 3), [chunk]) == " (experts missing or incomplete: expert 2-3)"


def test_missing_experts_are_named_as_spans():
    assert expert_note(GATE_UP, SHAPE, [piece(0, 4)]) == " (experts missing or incomplete: expert 4-7)"
    assert expert_note(GATE_UP, SHAPE, [piece(0, 1), piece(3, 2), piece(6, 1)]) == \
        " (experts missing or incomplete: expert 1-2, 5, 7)"
    assert expert_note(GATE_UP, SHAPE, [piece(1, 7)]) == " (experts missing or incomplete: expert 0)"


def test_an_expert_with_only_some_of_its_rows_is_incomplete():
    # Expert 2 holds rows 0-2 of its 4 (6 of 8 elements); expert 5 holds rows 1-3 and again rows 0-1
    # (10 of 8 elements: row 1 twice, so "stored twice").
    chunks = [piece(0, 2), piece(2, 1, rows=(0, 3)), piece(3, 2), piece(5, 1, rows=(1, 3)), piece(5, 1, rows=(0, 2)),
              piece(6, 2)]
    assert expert_note(GATE_UP, SHAPE, chunks) == " (experts missing or incomplete: expert 2; stored twice: expert 5)"


def test_experts_stored_twice_or_past_the_end():
    assert expert_note(GATE_UP, SHAPE, [piece(0, 4), piece(0, 4)]) == \
        " (experts missing or incomplete: expert 4-7; stored twice: expert 0-3)"
    assert expert_note(GATE_UP, SHAPE, [piece(0, 4), piece(8, 4)]) == \
        " (experts missing or incomplete: expert 4-7; beyond the model's 8 experts: expert 8-11)"
    # Past the end twice: only "beyond", never "stored twice" (that counts the model's experts only).
    assert expert_note(GATE_UP, SHAPE, [piece(0, 8), piece(8, 2), piece(8, 2)]) == \
        " (experts beyond the model's 8 experts: expert 8-9)"
    assert expert_note(GATE_UP, SHAPE, [piece(0, 8), piece(7, 2)]) == \
        " (experts stored twice: expert 7; beyond the model's 8 experts: expert 8)"


def test_a_region_counts_only_its_experts_and_its_rows():
    # Region: experts 4-7, rows 2-3 (per expert 2 x 2 = 4 elements).
    region = ((4, 2, 0), (4, 2, 2))
    # Experts 0-3 are absent but outside the region: not named.
    assert expert_note(GATE_UP, SHAPE, [piece(4, 4)], region) == ""
    # Rows 0-1 of experts 4-7 overlap the region in no row: every expert of it missing.
    assert expert_note(GATE_UP, SHAPE, [piece(4, 4, rows=(0, 2))], region) == \
        " (experts missing or incomplete: expert 4-7)"
    # Rows 1-2 overlap it in row 2 only (2 of 4 elements); row 3 from another chunk completes 4-5.
    assert expert_note(GATE_UP, SHAPE, [piece(4, 4, rows=(1, 2)), piece(4, 2, rows=(3, 1))], region) == \
        " (experts missing or incomplete: expert 6-7)"
    # A chunk reaching past the region's experts counts only inside it: 0-7 whole, region 4-7 complete.
    assert expert_note(GATE_UP, SHAPE, [piece(0, 8)], region) == ""
    assert expert_note(GATE_UP, SHAPE, [piece(0, 8), piece(2, 3)], region) == " (experts stored twice: expert 4)"


def test_spans():
    assert _spans([0, 1, 2, 5]) == "0-2, 5"
    assert _spans([3]) == "3"
    assert _spans([1, 3, 4]) == "1, 3-4"


def test_edges_of_the_counts():
    region = ((4, 2, 0), (4, 2, 2))  # experts 4-7, rows 2-3
    # Rows 0 and 1 only: no element of the region's rows, however many chunks.
    assert expert_note(GATE_UP, SHAPE, [piece(4, 4, rows=(0, 1)), piece(4, 4, rows=(1, 1))], region) == \
        " (experts missing or incomplete: expert 4-7)"
    # Expert 4 twice, but the region is experts 0-3: not counted.
    assert expert_note(GATE_UP, SHAPE, [piece(0, 8), piece(4, 1)], ((0, 0, 0), (4, 4, 2))) == ""
    # One element per expert: an expert no chunk holds is still missing.
    bias = "layers.0.feed_forward.experts.down.bias"
    chunk = Chunk(bias, "param", "float32", (4, 1), (0, 0), (2, 1), "f", 0, 8, "crc32:00000000")
    assert expert_note(bias, (4, 1), [chunk]) == " (experts missing or incomplete: expert 2-3)"
    # No element per expert: nothing can be missing or twice.
    assert expert_note(bias, (4, 0), []) == ""
