"""qasr-bench's command line: the subcommands are listed and each answers --help under its own name."""

from __future__ import annotations

import pytest

from qasr.bench import cli


def test_help_lists_every_subcommand_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    for name, (_, summary) in cli.COMMANDS.items():
        assert name in out and summary.split()[0] in out


def test_no_or_an_unknown_subcommand_is_a_usage_error(capsys):
    for argv in ([], ["online"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2 and "usage: qasr-bench" in capsys.readouterr().err


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_each_subcommand_answers_help_under_its_qasr_bench_name(command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith(f"usage: qasr-bench {command} ")


def test_a_subcommands_options_reach_its_module_parsed(monkeypatch):
    ran = []
    monkeypatch.setattr("qasr.bench.partial_reuse.run", ran.append)
    cli.main(["partial-reuse", "--seconds", "4", "--tokens", "2"])
    assert (ran[0].seconds, ran[0].tokens, ran[0].size) == (4.0, 2, "tiny")
    with pytest.raises(SystemExit) as exc:
        cli.main(["partial-reuse", "--no-such-option"])
    assert exc.value.code == 2
