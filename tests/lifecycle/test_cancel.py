"""beam_hpc.lifecycle.cancel: what ``beam-hpc cancel`` accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from beam_hpc.errors import InputError
from beam_hpc.lifecycle.cancel import cancel_run


def test_cancel_of_a_directory_that_is_no_run_is_an_input_error(tmp_path: Path) -> None:
    from beam_hpc.cli.app import main

    with pytest.raises(InputError, match="no plan.json and no ledger.jsonl"):
        cancel_run(str(tmp_path / "nothing"))
    assert not (tmp_path / "nothing").exists()  # no flag written anywhere
    assert main(["cancel", str(tmp_path / "nothing")]) == 2
