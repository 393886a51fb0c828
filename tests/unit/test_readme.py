"""The README stays true: its two commands are the ones CI and users run, and the configuration
reference it links to is the generated one."""

from __future__ import annotations

from ftrain.testbed.procs import REPO
from tests.script_support import load_script


def test_config_reference_is_current():
    page = (REPO / "docs" / "configuration.md").read_text()
    assert load_script("update_config_reference").render(page) == page, "the reference is stale: run `make docs`"


def test_readme_commands_exist_and_ci_runs_the_test_command():
    readme = (REPO / "README.md").read_text()
    assert "\nmake demo\n" in readme and "\nmake test\n" in readme
    makefile = (REPO / "Makefile").read_text()
    assert "\ndemo:" in makefile and "\ntest:" in makefile
    assert "make test" in (REPO / ".ci" / "run").read_text()
