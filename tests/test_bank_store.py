"""The bank store and `lopd bank add-rollouts / export / rm / stats / show`: all-or-nothing per
file, --skip-invalid, dedupe, lossless export round trip, schema version."""

import json
import sqlite3

import pytest

from lopd_cli.bank.store import SCHEMA_VERSION, Bank
from lopd_cli.cli.main import run
from lopd_cli.errors import LopdError
from lopd_cli.project import init_project


def record(i, reward=1.0, **kw):
    r = {"task_id": f"t{i}", "instruction": f"Task number {i}",
         "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": f"Task number {i}"},
                      {"role": "assistant", "content": None,
                       "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": {"i": i}}}]},
                      {"role": "tool", "tool_call_id": "c1", "content": "x" * (i % 7)},
                      {"role": "assistant", "content": f"done {i}"}],
         "reward": reward, "tools": [{"type": "function", "function": {"name": "get", "parameters": {}}}],
         "meta": {"env": "orders" if i % 2 else "code"}}
    r.update(kw)
    return r


def write_jsonl(path, lines):
    path.write_text("".join((l if isinstance(l, str) else json.dumps(l)) + "\n" for l in lines))
    return path


@pytest.fixture
def project(tmp_path):
    return init_project(tmp_path / "proj", example="orders", model="tiny")


def lopd(capsys, *args):
    try:
        run([str(a) for a in args])
        rc = 0
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def rows(path):
    con = sqlite3.connect(path)
    out = con.execute("SELECT task_id, instruction, messages, tools, reward, success, meta, content_hash "
                      "FROM rollouts ORDER BY id").fetchall()
    con.close()
    return out


def test_default_rejects_the_whole_file_and_names_each_bad_line(project, tmp_path, capsys):
    f = write_jsonl(tmp_path / "r.jsonl", [record(1), "oops", record(2), {"messages": [], "reward": 1}, record(3, reward="x")])
    rc, out, err = lopd(capsys, "bank", "add-rollouts", f, "-C", project.root)
    assert rc == 1
    assert f"{f}:2: not JSON" in err and f"{f}:4: no messages" in err and f"{f}:5: reward must be a number" in err
    assert "error:" in err and "nothing" in err
    assert Bank(project.bank_path()).count() == 0


def test_skip_invalid_adds_the_valid_lines_and_lists_the_skipped(project, tmp_path, capsys):
    f = write_jsonl(tmp_path / "r.jsonl", [record(1), "oops", record(2, reward=0.5), "", record(3)])
    rc, out, err = lopd(capsys, "bank", "add-rollouts", f, "--skip-invalid", "-C", project.root, "--json")
    assert rc == 0, err
    res = json.loads(out)
    assert (res["added"], res["invalid"], res["successes"], res["duplicates"]) == (3, 1, 2, 0)
    assert res["files"][0]["invalid_lines"] == [{"line": 2, "reason": "not JSON (Expecting value at column 1)"}]
    assert f"{f}:2: not JSON" in err and "(skipped)" in err
    bank = Bank(project.bank_path())
    assert bank.count() == 3 and bank.count(success_only=True) == 2
    assert [i.task_id for i in bank.items()] == ["t1", "t3"]


def test_other_files_still_go_in_when_one_is_rejected(project, tmp_path, capsys):
    good = write_jsonl(tmp_path / "good.jsonl", [record(1), record(2)])
    bad = write_jsonl(tmp_path / "bad.jsonl", [record(3), "nope"])
    rc, out, err = lopd(capsys, "bank", "add-rollouts", good, bad, "-C", project.root)
    assert rc == 1 and "bad.jsonl" in err
    assert sorted(i.task_id for i in Bank(project.bank_path()).items()) == ["t1", "t2"]


def test_readding_adds_nothing_and_counts_duplicates(project, tmp_path, capsys):
    f = write_jsonl(tmp_path / "r.jsonl", [record(i) for i in range(5)] + [record(0)])
    rc, out, _ = lopd(capsys, "bank", "add-rollouts", f, "-C", project.root, "--json")
    assert (json.loads(out)["added"], json.loads(out)["duplicates"]) == (5, 1)
    rc, out, _ = lopd(capsys, "bank", "add-rollouts", f, "-C", project.root)
    assert rc == 0 and "added 0, duplicates 6" in out
    assert Bank(project.bank_path()).count() == 5


def test_stdin_and_min_reward(project, tmp_path, capsys, monkeypatch):
    import io
    import sys

    data = "".join(json.dumps(record(i, reward=i / 10)) + "\n" for i in range(10)).encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    rc, out, err = lopd(capsys, "bank", "add-rollouts", "-", "--min-reward", "0.5", "-C", project.root, "--json")
    assert rc == 0, err
    assert json.loads(out)["successes"] == 5
    assert [i.reward for i in Bank(project.bank_path()).items()] == [0.5, 0.6, 0.7, 0.8, 0.9]


def test_export_then_add_into_a_fresh_bank_gives_identical_rows(project, tmp_path, capsys):
    recs = [record(i, reward=[1, 0.3, 0.85][i % 3]) for i in range(12)]
    recs[4] = {"messages": [{"role": "user", "content": "unicode ✓ – no task id"}], "reward": 1, "custom": {"a": [1]}}
    recs[5]["messages"][2]["tool_calls"][0]["function"]["arguments"] = '{"i": 5, "raw": "string args"}'
    f = write_jsonl(tmp_path / "in.jsonl", recs)
    assert lopd(capsys, "bank", "add-rollouts", f, "-C", project.root)[0] == 0
    out = tmp_path / "export.jsonl"
    rc, _, err = lopd(capsys, "bank", "export", out, "-C", project.root)
    assert rc == 0, err
    fresh = init_project(tmp_path / "fresh", example="orders", model="tiny")
    rc, _, err = lopd(capsys, "bank", "add-rollouts", out, "-C", fresh.root)
    assert rc == 0, err
    a, b = rows(project.bank_path()), rows(fresh.bank_path())
    assert len(a) == 12 and a == b
    # and the export of the fresh bank is byte-identical
    out2 = tmp_path / "export2.jsonl"
    lopd(capsys, "bank", "export", out2, "-C", fresh.root)
    assert out.read_bytes() == out2.read_bytes()


def test_show_stats_and_rm(project, tmp_path, capsys):
    f = write_jsonl(tmp_path / "r.jsonl", [record(i, reward=1.0 if i < 3 else 0.1) for i in range(5)])
    lopd(capsys, "bank", "add-rollouts", f, "-C", project.root)
    rc, out, _ = lopd(capsys, "bank", "stats", "-C", project.root, "--json")
    s = json.loads(out)
    assert (s["total"], s["successes"], s["indexed"]) == (5, 3, None)
    assert {e["env"]: e["total"] for e in s["per_env"]} == {"code": 3, "orders": 2}
    assert sum(b["count"] for b in s["reward_histogram"]) == 5
    assert [b["count"] for b in s["reward_histogram"] if b["count"]] == [2, 3]
    rc, out, _ = lopd(capsys, "bank", "show", "2", "-C", project.root, "--json")
    shown = json.loads(out)
    assert shown["task_id"] == "t1" and shown["source_line"] == 2 and shown["source_file"] == str(f)
    rc, out, _ = lopd(capsys, "bank", "show", "2", "-C", project.root)
    assert 'call get({"i": 1})' in out
    rc, _, err = lopd(capsys, "bank", "rm", "2", "99", "-C", project.root)
    assert rc == 1 and "99" in err
    assert Bank(project.bank_path()).count() == 5
    rc, out, _ = lopd(capsys, "bank", "rm", "2", "3", "-C", project.root, "--json")
    assert json.loads(out)["removed"] == [2, 3]
    bank = Bank(project.bank_path())
    assert bank.count() == 3 and [i.task_id for i in bank.items(success_only=False)] == ["t0", "t3", "t4"]
    with pytest.raises(LopdError, match="no rollout with id 2"):
        bank.get(2)


def test_add_records_api_returns_ids_and_rejects_bad_records(tmp_path):
    bank = Bank(tmp_path / "b.sqlite", min_reward=0.5)
    res = bank.add_records([record(1, reward=0.4), record(2)], source="runner")
    assert (res.added, res.successes) == (2, 1) and len(res.ids) == 2
    assert [bank.get(i).task_id for i in res.ids] == ["t1", "t2"]
    with pytest.raises(LopdError, match=r"runner:#1: reward must be a number"):
        bank.add_records([record(3), record(4, reward=None) | {"reward": "x"}])
    assert bank.count() == 2


def test_newer_schema_is_a_clear_error_and_garbage_is_not_a_bank(tmp_path):
    path = tmp_path / "b.sqlite"
    Bank(path).close()
    con = sqlite3.connect(path)
    con.execute("UPDATE bank_info SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    con.commit()
    con.close()
    with pytest.raises(LopdError, match="newer lopd"):
        Bank(path)
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(LopdError, match="not a lopd bank"):
        Bank(junk)


def test_missing_bank_is_a_clear_error(project, capsys):
    rc, _, err = lopd(capsys, "bank", "stats", "-C", project.root)
    assert rc == 1 and "no bank yet" in err
