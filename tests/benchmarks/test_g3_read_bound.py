"""benchmarks/g3_read_bound.py, at a tiny size: it builds its C harness, every mode reads every byte
it wrote, and the checking modes' hashes are those of the files' entries (a short read or other
bytes make the script exit non-zero)."""
from __future__ import annotations

import json

import pytest

from bench_scripts import load_script


def test_every_mode_reads_the_whole_round_at_each_thread_count(tmp_path, capsys):
    bound = load_script("g3_read_bound.py", "g3_read_bound")
    out = tmp_path / "bound.json"
    # 100 tokens of 16-token entries of 16 KiB: 7 entries, three to a file, so 3 files (9 entries)
    assert bound.main(["--dir", str(tmp_path), "--tokens", "100", "--rounds", "2", "--threads", "1,3",
                       "--file-mib", "0.05", "--pieces", "4", "--token-bytes", "256", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    work = doc["workload"]
    assert (work["entry_bytes"], work["entries_per_file"], work["files"]) == (16 * 256 * 4, 3, 3)
    assert work["bytes_per_round"] == work["files"] * work["entries_per_file"] * work["entry_bytes"]
    got = {(r["mode"], r["threads"]) for r in doc["results"]}
    assert got == {(m, t) for m in ("raw read", "into G1", "into G1 + check", "via cache", "via cache + check")
                   for t in (1, 3)}
    assert all(len(r["seconds"]) == 2 and r["GBps"] > 0 for r in doc["results"])
    assert "into G1 + check" in capsys.readouterr().out
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # its data files are gone


@pytest.mark.parametrize("argv", [["--threads", "two"], ["--threads", "0"], ["--tokens", "0"]])
def test_bad_flags_exit_2_naming_the_flag(argv, capsys):
    bound = load_script("g3_read_bound.py", "g3_read_bound")
    with pytest.raises(SystemExit) as e:
        bound.main(argv)
    assert e.value.code == 2 and argv[0] in capsys.readouterr().err
