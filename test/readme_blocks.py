"""The code blocks of README.md and docs/*.md, as a user copies them.

A Python block right after ``<!-- needs: PACKAGE -->`` is a recipe for that package's trainer: the
integration tests run docs/integrations.md's (``test/integrations/test_readme_recipes.py``). README.md's
Python blocks run in ``test/test_readme.py``, docs/extending.md's in ``test/test_extending_guide.py``.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple, Optional

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


class Block(NamedTuple):
    lang: str
    code: str
    #: the package a recipe needs (its ``<!-- needs: ... -->``), or None
    needs: Optional[str]


def readme_blocks(lang: str, path: str = README) -> list[Block]:
    """The ``lang`` blocks of the markdown file ``path`` (default: README.md), in order."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return [Block(lang, code, needs or None)
            for needs, code in re.findall(rf"(?:<!-- needs: (\S+) -->\n)?^```{lang}\n(.*?)^```$", text, re.S | re.M)]


def readme_text() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()
