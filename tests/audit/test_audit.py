"""The audit log itself: the chain, rotation, verify naming what was tampered with, HMAC, concurrent writers,
write failures, and the settings that place it."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path

import pytest

from execbox.audit import fields as audit_fields
from execbox.audit import log as audit
from execbox.audit import reader as audit_reader
from execbox.audit.log import GENESIS, AuditLog
from execbox.audit.reader import verify
from execbox.config.settings import Settings
from execbox.errors import ConfigError

KEY = b"operator-key-0123456789"


def lines_of(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


def write_lines(path: Path, lines: list[str]) -> None:
    path.write_text("".join(lines))


def filled(tmp_path: Path, n: int = 10, *, key: bytes | None = None, max_bytes: int = 1 << 20) -> Path:
    log = AuditLog(tmp_path / "audit.jsonl", key=key, max_bytes=max_bytes)
    for i in range(n):
        assert log.record("approval.request", tool="run", n=i) is None
    return tmp_path / "audit.jsonl"


def rebuild(path: Path, lines: list[str], *, alg: str = "sha256", key: bytes | None = None) -> None:
    """What a writer without the key can do after an edit: recompute every hash, link and the head."""
    prev, out, rec = GENESIS, [], {}
    for line in lines:
        rec = json.loads(line)
        rec["alg"], rec["prev"] = alg, prev
        rec["hash"] = audit.digest(rec, key)
        prev = rec["hash"]
        out.append(json.dumps(rec) + "\n")
    write_lines(path, out)
    head = {"seq": rec["seq"], "hash": prev, "alg": alg, "mac": audit.head_mac(rec["seq"], prev, key)}
    path.with_name(path.name + ".head").write_text(json.dumps(head))


class TestChain:
    def test_each_record_carries_the_hash_of_the_one_before(self, tmp_path: Path) -> None:
        path = filled(tmp_path, 5)
        records = [json.loads(line) for line in lines_of(path)]
        assert [r["seq"] for r in records] == [1, 2, 3, 4, 5]
        assert records[0]["prev"] == GENESIS
        for before, after in zip(records, records[1:], strict=False):
            assert after["prev"] == before["hash"]
            assert before["hash"] == hashlib.sha256(audit.canonical({k: v for k, v in before.items()
                                                                      if k != "hash"})).hexdigest()
        assert records[2]["event"] == "approval.request" and records[2]["n"] == 2 and records[2]["tool"] == "run"
        assert records[2]["caller"]["pid"] == os.getpid() and records[2]["caller"]["uid"] == os.getuid()

    def test_verify_passes_on_an_untouched_log(self, tmp_path: Path) -> None:
        report = verify(filled(tmp_path, 10))
        assert report.ok and report.problem is None and report.records == 10 and report.last_seq == 10

    def test_rotation_keeps_the_chain_across_files(self, tmp_path: Path) -> None:
        path = filled(tmp_path, 40, max_bytes=4096)
        files = audit.log_files(path)
        assert len(files) >= 3 and files[-1] == path
        assert all(f.stat().st_size <= 4096 for f in files)
        last_of_old = json.loads(lines_of(files[-2])[-1])
        first_of_new = json.loads(lines_of(files[-1])[0])
        assert first_of_new["prev"] == last_of_old["hash"] and first_of_new["seq"] == last_of_old["seq"] + 1
        report = verify(path)
        assert report.ok and report.records == 40 and report.files == len(files)

    def test_a_removed_rotated_file_is_named(self, tmp_path: Path) -> None:
        path = filled(tmp_path, 40, max_bytes=4096)
        middle = audit.log_files(path)[1]
        first_missing = json.loads(lines_of(middle)[0])["seq"]
        middle.unlink()
        assert f"records seq {first_missing} to" in (verify(path).problem or "")

    def test_oversize_records_are_stubs_that_still_chain(self, tmp_path: Path) -> None:
        log = AuditLog(tmp_path / "audit.jsonl")
        assert log.record("approval.request", blob="x" * (audit.MAX_RECORD_BYTES + 10)) is None
        rec = json.loads(lines_of(tmp_path / "audit.jsonl")[0])
        assert rec["oversize"] > audit.MAX_RECORD_BYTES and "blob" not in rec and len(rec["fields_sha256"]) == 64
        assert verify(tmp_path / "audit.jsonl").ok

    def test_a_torn_last_line_is_cut_and_its_loss_recorded(self, tmp_path: Path) -> None:
        path = filled(tmp_path, 3)
        with open(path, "a") as fh:
            fh.write('{"seq":4,"ts":"2026-')  # a crash mid-write
        assert "incomplete" in (verify(path).problem or "")
        AuditLog(path).record("approval.decision", approved=True)
        records = [json.loads(line) for line in lines_of(path)]
        assert [r["event"] for r in records[3:]] == ["audit.torn", "approval.decision"]
        report = verify(path)
        assert report.ok and any("torn" in w for w in report.warnings)


class TestTamperingIsNamed:
    def test_an_edited_record(self, tmp_path: Path) -> None:
        path = filled(tmp_path)
        lines = lines_of(path)
        rec = json.loads(lines[2])
        rec["n"] = 999
        lines[2] = json.dumps(rec) + "\n"
        write_lines(path, lines)
        problem = verify(path).problem or ""
        assert "record seq 3 (audit.jsonl:3) was edited" in problem

    def test_an_edited_record_whose_hash_was_recomputed(self, tmp_path: Path) -> None:
        path = filled(tmp_path)
        lines = lines_of(path)
        rec = json.loads(lines[2])
        rec["n"] = 999
        rec["hash"] = audit.digest(rec, None)
        lines[2] = json.dumps(rec) + "\n"
        write_lines(path, lines)
        problem = verify(path).problem or ""
        assert "record seq 3 (audit.jsonl:3) was edited (its hash recomputed)" in problem

    def test_a_deleted_record(self, tmp_path: Path) -> None:
        path = filled(tmp_path)
        lines = lines_of(path)
        del lines[4]
        write_lines(path, lines)
        assert verify(path).problem == "records seq 5 were removed (before seq 6, audit.jsonl:5)"

    def test_reordered_records(self, tmp_path: Path) -> None:
        path = filled(tmp_path)
        lines = lines_of(path)
        lines[3], lines[4] = lines[4], lines[3]
        write_lines(path, lines)
        problem = verify(path).problem or ""
        assert problem.startswith("record seq 5 (audit.jsonl:4) is out of order: seq 4 comes after it")

    def test_a_truncated_log(self, tmp_path: Path) -> None:
        path = filled(tmp_path)
        write_lines(path, lines_of(path)[:7])
        problem = verify(path).problem or ""
        assert "truncated" in problem and "ends at seq 7" in problem and "seq 8 to 10" in problem

    def test_a_truncation_stays_visible_after_more_records_are_written(self, tmp_path: Path) -> None:
        path = filled(tmp_path)
        write_lines(path, lines_of(path)[:7])
        AuditLog(path).record("approval.request", after=True)  # the writer chains on, and says what it found
        problem = verify(path).problem or ""
        assert problem.startswith("record seq 8 (audit.jsonl:8): a writer found the log cut short (it ended at seq 7, "
                                  "the head named seq 10)")

    def test_a_cut_inside_a_record_is_not_mistaken_for_a_crash(self, tmp_path: Path) -> None:
        path = filled(tmp_path)
        text = path.read_text()
        path.write_text(text[: text.index('"seq":6') + 10])  # mid-record 6: looks like a torn write
        AuditLog(path).record("approval.request", after=True)
        events = [json.loads(line)["event"] for line in lines_of(path)[5:]]
        assert events == ["audit.torn", "audit.gap", "approval.request"]
        assert "cut short (it ended at seq 6, the head named seq 10)" in (verify(path).problem or "")

    def test_a_log_cut_to_nothing(self, tmp_path: Path) -> None:
        path = filled(tmp_path)
        path.write_text("")
        assert "truncated" in (verify(path).problem or "")

    def test_the_first_records_removed(self, tmp_path: Path) -> None:
        path = filled(tmp_path)
        write_lines(path, lines_of(path)[2:])
        assert verify(path).problem == "records seq 1 to 2 were removed (before seq 3, audit.jsonl:1)"

    def test_a_missing_head_file_is_a_problem(self, tmp_path: Path) -> None:
        path = filled(tmp_path)
        path.with_name("audit.jsonl.head").unlink()
        assert "head file audit.jsonl.head is missing" in (verify(path).problem or "")

    def test_a_removed_head_stays_visible_after_more_records_are_written(self, tmp_path: Path) -> None:
        path = filled(tmp_path)
        write_lines(path, lines_of(path)[:7])
        path.with_name("audit.jsonl.head").unlink()  # cut, and hide the cut from the head
        AuditLog(path).record("approval.request", after=True)
        problem = verify(path).problem or ""
        assert problem.startswith("record seq 8 (audit.jsonl:8): a writer found the head file missing at seq 7")

    def test_a_foreign_line(self, tmp_path: Path) -> None:
        path = filled(tmp_path)
        lines = lines_of(path)
        lines.insert(5, "hello\n")
        write_lines(path, lines)
        assert verify(path).problem == "audit.jsonl:6: not an audit record (edited, or written by something else)"

    def test_no_log_at_all_is_not_intact(self, tmp_path: Path) -> None:
        report = verify(tmp_path / "absent.jsonl")
        assert not report.ok and "no audit log" in (report.problem or "")


class TestHmac:
    def test_a_keyed_log_verifies_with_its_key(self, tmp_path: Path) -> None:
        path = filled(tmp_path, key=KEY)
        assert all(json.loads(line)["alg"] == "hmac-sha256" for line in lines_of(path))
        assert verify(path, KEY).ok

    def test_an_edit_rebuilt_as_a_plain_chain_is_caught_with_the_key(self, tmp_path: Path) -> None:
        path = filled(tmp_path, key=KEY)
        lines = lines_of(path)
        rec = json.loads(lines[2])
        rec["n"] = 999
        lines[2] = json.dumps(rec) + "\n"
        rebuild(path, lines)  # every hash, link and the head recomputed: without the key, all plain SHA-256
        assert verify(path).ok  # the limit of a plain chain: without the key, a rebuild is consistent
        problem = verify(path, KEY).problem or ""
        assert "no record carries a MAC" in problem

    def test_a_partial_rebuild_is_named_at_the_first_record_it_changed(self, tmp_path: Path) -> None:
        path = filled(tmp_path, key=KEY)
        lines = lines_of(path)
        rec = json.loads(lines[5])
        rec["n"] = 999
        lines[5] = json.dumps(rec) + "\n"
        head, tail = lines[:5], lines[5:]
        # Rebuild from the edit on, linking to the genuine record 5, as plain SHA-256 (the key is not known).
        prev, out = json.loads(head[-1])["hash"], []
        for line in tail:
            r = json.loads(line)
            r["alg"], r["prev"] = "sha256", prev
            r["hash"] = prev = audit.digest(r, None)
            out.append(json.dumps(r) + "\n")
        write_lines(path, head + out)
        problem = verify(path, KEY).problem or ""
        assert problem.startswith("record seq 6 (audit.jsonl:6) is not MAC'd although earlier records are")

    def test_a_rebuild_under_a_guessed_key_fails_at_the_edit(self, tmp_path: Path) -> None:
        path = filled(tmp_path, key=KEY)
        lines = lines_of(path)
        rec = json.loads(lines[2])
        rec["n"] = 999
        lines[2] = json.dumps(rec) + "\n"
        rebuild(path, lines, alg="hmac-sha256", key=b"a guess")
        problem = verify(path, KEY).problem or ""
        assert problem.startswith("record seq 1 (audit.jsonl:1) was edited") and "the key is not the one" in problem

    def test_without_the_key_the_macs_are_not_claimed_checked(self, tmp_path: Path) -> None:
        report = verify(filled(tmp_path, key=KEY))
        assert report.problem is None and report.unauthenticated and not report.ok


class TestConcurrentWriters:
    def test_threads_leave_one_valid_chain(self, tmp_path: Path) -> None:
        path = tmp_path / "audit.jsonl"
        logs = [AuditLog(path, max_bytes=16 << 10) for _ in range(2)]  # two logs (one per "component") on one file

        def write(i: int) -> None:
            for j in range(50):
                assert logs[i % 2].record("approval.request", thread=i, n=j) is None

        threads = [threading.Thread(target=write, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        report = verify(path)
        assert report.ok and report.records == 400 and report.files > 1
        seen = {(r["thread"], r["n"]) for r in audit_reader.records(path)}
        assert seen == {(i, j) for i in range(8) for j in range(50)}

    def test_verify_while_writers_write_sees_a_consistent_log(self, tmp_path: Path) -> None:
        path = tmp_path / "audit.jsonl"
        log = AuditLog(path, max_bytes=8 << 10)
        log.record("approval.request", n=-1)
        done = threading.Event()

        def write() -> None:
            for n in range(300):
                log.record("approval.request", n=n)
            done.set()

        writer = threading.Thread(target=write)
        writer.start()
        reports = []
        while not done.is_set():
            reports.append(verify(path))
        writer.join()
        reports.append(verify(path))
        assert [r.problem for r in reports if r.problem] == []
        assert reports[-1].records == 301 and len(reports) > 1


class TestFailures:
    def test_an_unwritable_log_returns_a_note_warns_and_is_kept_for_doctor(self, tmp_path: Path) -> None:
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        log = AuditLog(blocker / "audit.jsonl")  # its directory is a regular file: no one can write there
        with pytest.warns(RuntimeWarning, match="NOT recorded"):
            note = log.record("approval.request", tool="run")
        assert note and "NOT recorded" in note and "CODE_EXEC_AUDIT_LOG" in note
        health = audit.health(log)
        assert health["failures"] == 1 and any("cannot be written" in p for p in health["problems"])
        assert health["last_failure"]["note"] == note

    def test_an_off_log_does_nothing_and_doctor_warns(self, tmp_path: Path) -> None:
        log = AuditLog.from_settings(Settings(audit_log="off"))
        assert not log.enabled and log.record("approval.request") is None
        assert any("off" in p for p in audit.health(log)["problems"])

    def test_a_reserved_field_is_a_note_not_a_crash(self, tmp_path: Path) -> None:
        with pytest.warns(RuntimeWarning):
            note = AuditLog(tmp_path / "audit.jsonl").record("approval.request", seq=5)
        assert note and "reserved" in note


class TestSettings:
    def test_the_default_is_the_per_user_state_path(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
        assert Settings().audit_log == str(tmp_path / "execbox" / "audit.jsonl")
        monkeypatch.delenv("XDG_STATE_HOME")
        monkeypatch.setenv("HOME", str(tmp_path / "home"))
        assert Settings().audit_log == str(tmp_path / "home" / ".local" / "state" / "execbox" / "audit.jsonl")

    def test_off(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("CODE_EXEC_AUDIT_LOG", "off")
        assert Settings().audit_log == "off"

    @pytest.mark.parametrize("where", ["/etc/execbox/audit.jsonl", "/usr/local/audit.jsonl", "/dev/shm/audit.jsonl"])
    def test_a_path_a_sandbox_binds_is_refused(self, where: str) -> None:
        with pytest.raises(ConfigError, match="CODE_EXEC_AUDIT_LOG") as info:
            Settings(audit_log=where)
        assert info.value.env_var == "CODE_EXEC_AUDIT_LOG"

    def test_a_path_inside_a_workspace_is_refused(self) -> None:
        inside = os.path.join(tempfile.gettempdir(), "execbox-bwrap-123-456-abc", "workspace", "audit.jsonl")
        with pytest.raises(ConfigError, match="inside a sandbox workspace"):
            Settings(audit_log=inside)

    def test_a_key_file_makes_an_hmac_chain(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        (tmp_path / "key").write_bytes(KEY + b"\n")
        monkeypatch.setenv("CODE_EXEC_AUDIT_KEY_FILE", str(tmp_path / "key"))
        monkeypatch.setenv("CODE_EXEC_AUDIT_LOG", str(tmp_path / "audit.jsonl"))
        log = AuditLog.from_settings(Settings())
        assert log.key == KEY
        log.record("approval.request")
        assert verify(tmp_path / "audit.jsonl", KEY).ok

    def test_an_empty_key_file_is_refused(self, tmp_path: Path) -> None:
        (tmp_path / "key").write_text("\n")
        with pytest.raises(ConfigError, match="is empty"):
            AuditLog.from_settings(Settings(audit_key_file=tmp_path / "key"))

    def test_declared_secrets_are_recorded_by_name_only(self) -> None:
        from types import SimpleNamespace

        request = SimpleNamespace(code=None, argv=["env"], stdin=None, files={}, env={"A": "1"}, workdir=None,
                                  secrets={"OPENAI_API_KEY": "sk-the-value-itself"})
        fields = audit_fields.request_fields(request, [])
        assert fields["secrets"] == ["OPENAI_API_KEY"] and "sk-the-value-itself" not in json.dumps(fields)

    def test_output_text_is_kept_only_when_asked_and_capped(self) -> None:
        assert "text" not in audit_fields.stream_fields("hello", 0)
        kept = audit_fields.stream_fields("hello world", 5)
        assert kept["text"] == "hello" and kept["text_truncated"] is True and kept["bytes"] == 11
