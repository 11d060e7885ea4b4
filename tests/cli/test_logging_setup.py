"""The one logging set-up (beam_hpc.logging_setup): one format, one console handler however often it
is set up, the stream as it is at each line, and module-named loggers also in a ``python -m`` program."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from beam_hpc import logging_setup

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (\S+) (INFO|WARNING|ERROR) (.*)$")


@pytest.fixture
def root_as_it_was() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for h in root.handlers:
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    root.setLevel(level)


def test_one_handler_in_one_format_however_often_it_is_set_up(tmp_path: Path) -> None:
    code = ("import logging\nfrom beam_hpc.logging_setup import log_to_stream, log_to_file\n"
            "log_to_stream(); log_to_stream(); log_to_stream('stdout')\n"
            f"log_to_file({str(tmp_path / 'seg.log')!r})\n"
            "logging.getLogger('beam_hpc.x').info('one line')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "" and len(out.stderr.splitlines()) == 1, out
    assert LINE.match(out.stderr.strip()).groups() == ("beam_hpc.x", "INFO", "one line")  # type: ignore[union-attr]
    assert LINE.match((tmp_path / "seg.log").read_text().strip()).groups() == ("beam_hpc.x", "INFO", "one line")  # type: ignore[union-attr]


def test_a_program_run_with_python_m_logs_under_its_module_name(tmp_path: Path) -> None:
    (tmp_path / "pkgx").mkdir()
    (tmp_path / "pkgx" / "__init__.py").write_text("")
    (tmp_path / "pkgx" / "prog.py").write_text(
        "from beam_hpc.logging_setup import log_to_stream, module_logger\n"
        "log = module_logger(__name__)\nlog_to_stream('stdout')\nlog.warning('from the program')\n")
    out = subprocess.run([sys.executable, "-m", "pkgx.prog"], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert LINE.match(out.stdout.strip()).groups() == ("pkgx.prog", "WARNING", "from the program")  # type: ignore[union-attr]


def test_the_handler_writes_to_the_stream_of_the_moment(root_as_it_was, capsys) -> None:
    """The CLI's handler stays on the root logger of a process that runs many commands (the tests):
    each line goes to the sys.stderr of its time, never to one captured and closed before."""
    logging_setup.log_to_stream(level=None)
    logging_setup.log_to_stream(level=None)
    logging.getLogger("beam_hpc.y").warning("first")
    first = capsys.readouterr().err
    logging.getLogger("beam_hpc.y").warning("second")
    second = capsys.readouterr().err
    assert [LINE.match(x).groups() for x in (first.strip(), second.strip())] == [  # type: ignore[union-attr]
        ("beam_hpc.y", "WARNING", "first"), ("beam_hpc.y", "WARNING", "second")]
    with pytest.raises(ValueError, match="stream 'stdin'"):
        logging_setup.log_to_stream("stdin")
