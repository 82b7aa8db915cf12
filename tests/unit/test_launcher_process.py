"""client.launcher_process: reading the launcher's output as a test or bench/chaos.py does."""

from __future__ import annotations

import queue

import pytest

from client.launcher_process import LauncherProcess, Service


def _reader(tmp_path) -> LauncherProcess:
    """A LauncherProcess with no process: its lines come from the test."""
    launcher = LauncherProcess.__new__(LauncherProcess)
    launcher.log_dir, launcher.lines, launcher.queue = tmp_path, [], queue.Queue()
    return launcher


def test_a_second_restart_of_the_same_service_is_waited_for(tmp_path):
    """The same replica killed twice: the second wait must read the second "restarted" line, not return on
    the first one read earlier (which named a pid that is gone: the drain test then signalled a dead pid)."""
    launcher = _reader(tmp_path)
    for line in ("  verify-1     verify      127.0.0.1:40001       pid 100      \n",
                 "[launcher] verify-1 exited (killed by SIGKILL) after 9 s; restart 1 in 0.5 s\n",
                 "[launcher] verify-1 restarted, pid 101\n"):
        launcher.queue.put(line)
    launcher.read_until("[launcher] verify-1 restarted")
    assert launcher.services()["verify-1"].pid == 101
    launcher.queue.put("[launcher] verify-1 exited (killed by SIGKILL) after 5 s; restart 2 in 1 s\n")
    launcher.queue.put("[launcher] verify-1 restarted, pid 102\n")
    launcher.read_until("[launcher] verify-1 restarted")
    assert launcher.services()["verify-1"] == Service("verify", "127.0.0.1:40001", 102)


def test_no_new_line_with_the_text_is_an_error_naming_what_was_awaited(tmp_path):
    launcher = _reader(tmp_path)
    launcher.queue.put("[launcher] verify-1 restarted, pid 101\n")
    launcher.read_until("verify-1 restarted")
    with pytest.raises(AssertionError, match="no 'verify-1 restarted' from the launcher"):
        launcher.read_until("verify-1 restarted", timeout_s=0.2)
