"""The documentation: the site builds with no warnings, its reference pages follow the code, README stays a front
door, RESULTS.md is what the result files say, and no user-facing file narrates how the project was developed."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("docs_gen_reference", REPO / "docs" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mkdocs() -> str:
    found = shutil.which("mkdocs", path=str(Path(sys.executable).parent))
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("mkdocs is not installed (the 'docs' extra, part of 'test')")
        pytest.skip("mkdocs is not installed (pip install -e '.[docs]')")
    return found


def test_site_builds_strict_with_the_generated_pages(tmp_path):
    """`make docs`'s build: any warning (a broken link or anchor, a page outside the nav) fails it."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "OMP_NUM_THREADS": "1"}
    site = tmp_path / "site"
    result = subprocess.run([_mkdocs(), "build", "--strict", "--site-dir", str(site)], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-5000:]
    for page in ("reference/cli.html", "reference/rewards.html", "reference/errors.html", "benchmarks.html"):
        assert (site / page).is_file(), page
    cli = (site / "reference" / "cli.html").read_text(encoding="utf-8")
    assert "--share_prompt" in cli and "vlm-grpo-data check" in cli and "--reward_funcs" in cli
    assert "9.7x" in (site / "benchmarks.html").read_text(encoding="utf-8")


PROBE = textwrap.dedent(
    '''
    import dataclasses, importlib.util, json, sys
    sys.path.insert(0, {src!r})
    import vlm_grpo.configs as configs
    import vlm_grpo.data.cli as data_cli
    from vlm_grpo.rewards import register_reward

    spec = importlib.util.spec_from_file_location("gen", {gen!r})
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    before = gen.cli_page() + gen.rewards_page()

    @register_reward("docs_probe_reward")
    def docs_probe_reward(completions, solution, strictness: float = 0.5, **kwargs):
        """Scores 1 when the probe likes the completion."""
        return [1.0 for _ in completions]

    @dataclasses.dataclass
    class Probed(configs.GRPOScriptArguments):
        docs_probe_flag: int = dataclasses.field(default=7, metadata={{"help": "A flag added by the probe."}})

    Probed.__module__ = "vlm_grpo.configs"  # as if written in the source
    configs.GRPOScriptArguments = Probed
    build = data_cli.build_parser

    def build_parser():
        parser = build()
        parser.add_argument("--docs_probe_option", default="x", help="An option added by the probe.")
        return parser

    data_cli.build_parser = build_parser
    after = gen.cli_page() + gen.rewards_page()
    print(json.dumps([before, after]))
    '''
)


def test_a_new_flag_reward_and_option_appear_in_the_reference_without_editing_docs(tmp_path):
    """Added at run time, as a change to the source would add them: the generated pages list them; the same pages
    generated before the additions do not (negative control)."""
    script = PROBE.format(src=str(REPO / "src"), gen=str(REPO / "docs" / "gen_reference.py"))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    before, after = json.loads(result.stdout.strip().splitlines()[-1])
    assert "docs_probe" not in before
    assert "| `--docs_probe_flag` | `7` | A flag added by the probe. |" in after
    assert "`--docs_probe_option`" in after and "An option added by the probe." in after
    assert "[`docs_probe_reward`]" in after and "Scores 1 when the probe likes the completion." in after
    assert re.search(r"strictness: '?float'? = 0\.5", after)


def test_error_messages_are_collected_from_the_source(tmp_path):
    """A new `raise` of a user error (a subclass of UserError, a ValueError, an argparse error) is listed with its
    text; a message built elsewhere (a variable) and a bug (TypeError) are not."""
    pkg = tmp_path / "vlm_grpo"
    pkg.mkdir()
    (pkg / "thing.py").write_text(
        textwrap.dedent(
            """
            from vlm_grpo.cli_errors import UserError

            class ThingError(UserError):
                pass

            class DeeperError(ThingError):
                pass

            def check(path, n, parser, message):
                if n < 0:
                    raise DeeperError(f"--things {n}: must be at least 0 (file {path})")
                if n > 9:
                    raise ValueError("too many " + "things; pass --things 9 or fewer")
                if n == 5:
                    parser.error("--things 5 is reserved")
                if n == 6:
                    raise TypeError("a bug, not a user error")
                if n == 7:
                    raise SystemExit(f"error: --things {n} and --stuff are the same option")
                if n == 8:
                    raise SystemExit("usage: things N")
                raise ThingError(message)
            """
        )
    )
    rows = _generator().error_messages(tmp_path)
    assert [(kind, text) for _, _, kind, text in rows] == [
        ("DeeperError", "--things {n}: must be at least 0 (file {path})"),
        ("ValueError", "too many things; pass --things 9 or fewer"),
        ("argparse", "--things 5 is reserved"),
        ("SystemExit", "--things {n} and --stuff are the same option"),
    ]
    assert len(_generator().error_messages()) > 100  # the package's own, on the generated page


def test_readme_is_a_short_front_door_whose_links_resolve():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    assert "make demo" in text and "make test" in text and "docs/curves.png" in text
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not link.startswith(("http://", "https://"))]
    assert len(local) > 20
    missing = [link for link in local if not (REPO / link).exists()]
    assert not missing, missing


def test_results_md_is_generated_from_the_result_files(tmp_path):
    """RESULTS.md is exactly what benchmarks/results_tables.py makes of the JSON files; a changed number in a file
    makes the check fail (negative control)."""
    script = REPO / "benchmarks" / "results_tables.py"
    check = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    text = (REPO / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    sections = re.findall(r"^## (\S+)$", text, re.M)
    assert sorted(sections) == sorted(p.stem for p in (REPO / "benchmarks" / "results").glob("*.json"))
    assert all("Card: **" in block and "Date: 2" in block and "```bash\npython benchmarks/" in block
               for block in text.split("\n## ")[2:])  # fmt: skip
    copy = tmp_path / "results"
    shutil.copytree(REPO / "benchmarks" / "results", copy)
    target = copy / "grpo_qwen2_5_vl_3b_448_c128_h100.json"
    data = json.loads(target.read_text())
    data["results"][0]["step_s"] = 2.0
    target.write_text(json.dumps(data))
    changed = subprocess.run([sys.executable, str(script), "--check", "--results", str(copy)], capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    assert changed.returncode == 1 and "out of date" in changed.stderr


HISTORY = re.compile(
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth"
    r"|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|twenty-\w+)[ -](session|round)s?\b"
    r"|\bround (one|two|three|four|five)\b|\bissues? #?\d+|(?<![\w&/])#\d+\b|\bi\d+[a-z]?_|\bsessions?\b",
    re.I,
)
# "session" in the sense of a running process is fine: a pytest session, an HTTP or sandbox session.
ALLOWED = re.compile(r"requests\.Session|httpx|ClientSession|aiohttp|interpreter|sandbox|Session\(|session_id", re.I)
SCANNED = ["README.md", "CHANGELOG.md", "docs", "benchmarks", "src/vlm_grpo", "Makefile", "configs", "run_scripts"]
SKIPPED = ("benchmarks/results/",)  # data


def test_no_user_facing_file_narrates_the_development_history():
    found = []
    for root in SCANNED:
        path = REPO / root
        for file in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
            rel = file.relative_to(REPO).as_posix()
            if rel.startswith(SKIPPED) or file.suffix in (".png", ".gz", ".pyc"):
                continue
            for number, line in enumerate(file.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                if HISTORY.search(line) and not ALLOWED.search(line):
                    found.append(f"{rel}:{number}: {line.strip()[:120]}")
    assert not found, "\n".join(found)
    n = 20  # negative controls, spelled so that this file itself does not match
    for text in (f"as before the twenty-{'fourth'} session", f"see issue {n}", f"results i{n}x_slices", f"in #{n}"):
        assert HISTORY.search(text), text
