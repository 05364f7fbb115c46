"""How the command line reports an error: one line (no traceback, also with DIFFTRANSFORMER_DEBUG=0), an
operating-system error naming the full path and the fix."""

from __future__ import annotations

import os

import pytest

from difftransformer.cli import main, os_error_message
from tests.helpers import cli_fails


def test_an_os_error_is_one_line_naming_the_path_and_the_fix():
    """Root writes into read-only folders and a full disk is hard to stage: the message of each refusal
    is checked on the error the operating system raises."""
    import errno

    from difftransformer.cli import os_error_message

    for code, needle in [(errno.ENOSPC, "no space left on the device while writing /r/x; free some space"),
                         (errno.EROFS, "/r/x is on a read-only file system"),
                         (errno.EACCES, "no permission to use /r/x"),
                         (errno.EISDIR, "/r/x is a folder where a file is expected")]:
        assert needle in os_error_message(OSError(code, os.strerror(code), "/r/x"))
    assert os_error_message(OSError("our own words")) == "our own words"


def test_version_and_a_debug_variable_set_to_zero_keep_one_line_errors(capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.startswith("difftransformer ")
    monkeypatch.setenv("DIFFTRANSFORMER_DEBUG", "0")  # "0" means off: a user mistake gets one line, no traceback
    cli_fails(capsys, ["report", "/nonexistent/study"], "is not a folder")


def test_a_relative_default_path_is_named_in_full(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    message = os_error_message(FileNotFoundError(2, "No such file or directory", "cache"))
    assert str(tmp_path / "cache") in message
