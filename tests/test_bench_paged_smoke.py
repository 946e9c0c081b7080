"""The paged-teacher benchmark's CPU smoke mode, in this process: its paged part on tiny shapes (three teachers
pinned, one on disk), so that the GPU benchmark never rots; nothing about speed."""

from __future__ import annotations

import sys

from launch import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_paged  # noqa: E402


def test_the_paged_part_runs_every_steps_per_switch_and_reports_it(tmp_path):
    args = bench_paged.parse_args(["--pair", "tiny", "--seq-len", "16", "--micro-batch", "2", "--warmup", "1",
                                   "--steps-per-switch", "1", "2", "--window", "4", "--disk-dir", str(tmp_path),
                                   "--out", str(tmp_path / "out")])
    args.part = "paged"
    part = bench_paged.run_part(args)
    assert part["kept"] == {"t0": "host", "t1": "host", "t2": "host", "t3": "disk"}
    assert [run["steps_per_switch"] for run in part["runs"]] == [1, 2]
    k1, k2 = part["runs"]
    assert k1["steps"] == 4 and k1["teachers_visited"] == ["t0", "t1", "t2", "t3"] and k1["pager_switches"] == 4
    assert k1["disk_teachers_visited"] == ["t3"] and k2["pager_switches"] == 2
    assert all(run["tokens_per_s"] > 0 for run in part["runs"])
    assert not list(tmp_path.glob("distill_kit_paged*"))  # the disk copy (its folder) deleted at the end
    table = bench_paged.markdown({"meta": {"date": "d", "machine": "CPU", "pair": "tiny", "dtype": "fp32",
                                           "seq_len": 16, "micro_batch": 2, "command": "c"}, "parts": [part]})
    assert "| paged k=1 | 1 |" in table and "t3 (disk: t3)" in table and ") on disk" in table
