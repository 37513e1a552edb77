"""The wheel carries the recipes and the docs: build_py copies recipes/ and docs/ into the package as
delft/_shipped/, where delft.shipped finds them (a checkout reads them where they are)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
SHIPPED = {"recipes": ("*.yaml",), "docs": ("*.md",)}


class BuildWithShippedFiles(build_py):
    """build_py, then recipes/**.yaml and docs/*.md copied under delft/_shipped in the build directory."""

    def run(self):
        super().run()
        if self.editable_mode:  # an editable install reads the checkout's own recipes/ and docs/
            return
        target = Path(self.build_lib) / "delft" / "_shipped"
        shutil.rmtree(target, ignore_errors=True)
        for folder, patterns in SHIPPED.items():
            for pattern in patterns:
                for src in sorted((HERE / folder).rglob(pattern)):
                    dest = target / src.relative_to(HERE)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(src, dest)


setup(cmdclass={"build_py": BuildWithShippedFiles})
