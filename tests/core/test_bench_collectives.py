"""``python -m benchmarks collectives``: what it reads from XLA's optimized HLO and how it relates a time to the
ring bound (pure Python: the job itself needs namespace hosts and runs as a benchmark)."""

from benchmarks import collectives


def test_collectives_are_read_from_optimized_hlo_lines():
    text = "\n".join([
        "  %all-to-all = (u16[1,8]{1,0}, u16[1,8]{1,0}) all-to-all(u16[1,8]{1,0} %a, u16[1,8]{1,0} %b), channel_id=1",
        "  %cp = u16[32768]{0} collective-permute(u16[32768]{0} %x), channel_id=2, source_target_pairs={{0,1},{1,0}}",
        "  %ar = f32[2,8]{1,0} all-reduce-start(f32[2,8]{1,0} %y), channel_id=3, to_apply=%add",
        "  %add = f32[8]{0} add(f32[8]{0} %p, f32[8]{0} %q)",
    ])
    assert collectives._collectives(text) == [
        ("all-to-all", "(u16[1,8], u16[1,8])"), ("collective-permute", "u16[32768]"), ("all-reduce", "f32[2,8]")]


def test_table_relates_each_time_to_its_ring_bound():
    # 1 M parameters on 2 hosts at 100 Mbit/s: the float32 ring bound is 2 * 1/2 * 4 MB * 8 / 1e8 = 0.32 s, the
    # 16-bit one 0.16 s, and a 16-bit collective alone (half an all-reduce's traffic) is held to 0.08 s.
    variants = {"f32-psum-each": {"median": 0.32, "collectives": [("all-reduce", "f32[1000000]")]},
                "bf16-ring-chunked": {"median": 0.2, "collectives": [("collective-permute", "u16[4]")] * 2},
                "u16-all-gather": {"median": 0.16, "collectives": [("all-gather", "u16[1000000]")]}}
    text = collectives.table({"command": "python -m benchmarks collectives", "rate": "100mbit", "hosts": 2,
                              "repeats": 3, "layouts": {"l": {"parameters": 1000000, "variants": variants}}})
    assert "| l | 1,000,000 | f32-psum-each | 0.3200 | 1.00 | 1.00x | all-reduce f32[1000000] x1 |" in text
    assert "| l | 1,000,000 | bf16-ring-chunked | 0.2000 | 1.25 | 1.60x | collective-permute u16[4] x2 |" in text
    assert "| l | 1,000,000 | u16-all-gather | 0.1600 | 2.00 | 2.00x | all-gather u16[1000000] x1 |" in text


def test_every_variant_has_a_program_and_every_layout_about_the_same_size():
    assert set(collectives.VARIANTS) == {"f32-psum-each", "f32-psum-packed", "bf16-detour", "u16-all-to-all",
                                         "u16-all-gather", "bf16-ring", "bf16-ring-chunked"}
    sizes = {name: sum(_count(shape) for shape in shapes) for name, shapes in collectives.LAYOUTS.items()}
    assert sizes["held-out"] == 1585162  # issue 25's held-out model, Dense 512-1024-1024-10
    assert all(1.5e6 <= size <= 1.8e6 for size in sizes.values()), sizes


def _count(shape):
    total = 1
    for size in shape:
        total *= size
    return total
