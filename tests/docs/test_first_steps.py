"""A new user's first steps: README says, right after its two `make` commands, that the other
commands need the environment they built (activate .venv or call .venv/bin/...), and every docs
page that shows commands says it before its first command; README and the Makefile agree on what
`make test` runs; the demo has one duration."""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ACTIVATE = "source .venv/bin/activate"


def test_readme_says_to_activate_the_environment_after_the_make_commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    first_block_end = text.index("```", text.index("```bash") + 3)
    next_heading = text.index("\n#", first_block_end)
    assert ACTIVATE in text[first_block_end:next_heading], text[:next_heading]
    assert ".venv/bin/megatron-lora" in text[first_block_end:next_heading]


def test_every_page_with_commands_says_it_before_the_first_command():
    pages = []
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        text = open(path).read()
        first = re.search(r"^\s*```(bash|sh)\n", text, re.M)
        if first is None:
            continue
        pages.append(path)
        assert ACTIVATE in text[:first.start()], f"{path}: no `{ACTIVATE}` before its commands"
    assert len(pages) >= 6, pages


def test_one_demo_duration():
    """The make command's comment and the description of what the demo runs give one figure."""
    text = open(os.path.join(ROOT, "README.md")).read()
    command = re.search(r"^make demo .*runs the demo on a tiny model \((about [\d.]+ minutes)\)",
                        text, re.M)
    described = re.search(r"What `make demo` runs \((about [\d.]+ minutes)", text)
    assert command and described and command.group(1) == described.group(1), text[:2000]
