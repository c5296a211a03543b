"""After each error a user can cause on a resume (a malformed TOML file, an unknown key, a wrong
type, a damaged checkpoint), the command is one line with its exit status, nothing on disk
changes, and the resume that follows ships every sample to the trainer exactly once."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from collections import Counter
from pathlib import Path

from test_cli_kill import RANKS, _cmd


def _with_config(out: Path, steps: int, config: Path) -> list[str]:
    cmd = _cmd(out, steps)
    return [*cmd[:4], str(config), *cmd[4:]]  # simulate CONFIG.toml --out ...


def _state(out: Path) -> dict[str, str]:
    return {
        str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def test_errors_on_resume_lose_nothing_and_the_resume_ships_every_sample_once(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    first = subprocess.run(_cmd(out, 2), capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    before = _state(out)

    bad = {
        "malformed.toml": ("[rollout\nbatch_groups = 2\n", "not valid TOML"),
        "unknown.toml": ("[rollout]\nbatch_grops = 2\n", "rollout.batch_grops"),
        "wrong-type.toml": ('[rollout]\nbatch_groups = "two"\n', "expected int, got str"),
    }
    for name, (text, needle) in bad.items():
        config = tmp_path / name
        config.write_text(text)
        done = subprocess.run(
            _with_config(out, 2, config), capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2, (name, done.stderr)
        assert done.stderr.count("\n") == 1, (name, done.stderr)
        assert needle in done.stderr, (name, done.stderr)
        assert str(config) in done.stderr, done.stderr  # the file (and line) is named
        assert _state(out) == before, f"{name}: the run directory changed"

    # Every checkpoint damaged: one line, exit 1, nothing moved or deleted without --fresh.
    checkpoints = sorted((out / "checkpoints").glob("step_*.ckpt"))
    assert checkpoints
    kept = {p: p.read_bytes() for p in checkpoints}
    for p in checkpoints:
        p.write_bytes(kept[p][: len(kept[p]) // 2])
    damaged = _state(out)
    done = subprocess.run(_cmd(out, 2), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert "--fresh" in done.stderr, done.stderr
    assert _state(out) == damaged
    for p, data in kept.items():
        p.write_bytes(data)  # the operator restores them (from a backup, say)

    final = subprocess.run(_cmd(out, 2), capture_output=True, text=True, timeout=120)
    assert final.returncode == 0, final.stderr
    last = int(re.search(r"steps \d+\.\.(\d+)", final.stdout).group(1))  # type: ignore[union-attr]
    assert last == 4
    shipped = 0
    fingerprints: Counter[str] = Counter()
    for rank in range(RANKS):
        records = [
            json.loads(line)
            for line in (out / "trainer" / f"rank_{rank}.jsonl").read_text().splitlines()
        ]
        assert [r["step"] for r in records] == [1, 2, 3, 4], f"rank {rank}"
        for r in records:
            for *_, digest in r["seqs"]:
                fingerprints[digest] += 1
    for run in (first, final):
        shipped += sum(int(n) for n in re.findall(r"^step +\d+: shipped +(\d+)", run.stdout, re.M))
    assert not [d for d, n in fingerprints.items() if n > 1], "a sample was trained twice"
    assert sum(fingerprints.values()) == shipped, "delivered != shipped: samples were lost"
