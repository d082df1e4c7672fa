"""Ships ``mlx_lily_hook.pth`` at the root of site-packages (the ``--lily`` startup hook),
for a wheel install and for an editable one alike; everything else is declared in
pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "mlx_lily_hook.pth"


class BuildPyWithPth(build_py):
    """``build_py`` that also puts the hook's ``.pth`` at the top of the built tree.

    A wheel ships ``build_lib``, so the file lands in site-packages. An editable wheel
    (PEP 660, setuptools >= 64, ``editable_mode``) ships only the finder setuptools writes,
    not ``build_lib``: its root is the ``install`` command's ``install_lib`` (the unpacked
    editable wheel), so the ``.pth`` is written there as well.
    """

    def run(self):
        super().run()
        self.copy_file(PTH, str(Path(self.build_lib) / PTH), preserve_mode=0)
        if getattr(self, "editable_mode", False):
            root = self.get_finalized_command("install").install_lib
            self.copy_file(PTH, str(Path(root) / PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib) / PTH)]

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        mapping[str(Path(self.build_lib) / PTH)] = PTH
        return mapping


setup(cmdclass={"build_py": BuildPyWithPth})
