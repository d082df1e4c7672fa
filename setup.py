"""Ships ``mlx_lily_hook.pth`` at the root of site-packages (the ``--lily`` startup hook);
everything else is declared in pyproject.toml."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "mlx_lily_hook.pth"


class BuildPyWithPth(build_py):
    def run(self):
        super().run()
        target = Path(self.build_lib) / PTH
        self.copy_file(PTH, str(target), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        return super().get_outputs(include_bytecode) + [str(Path(self.build_lib) / PTH)]

    def get_output_mapping(self):
        mapping = super().get_output_mapping()
        mapping[str(Path(self.build_lib) / PTH)] = PTH
        return mapping


setup(cmdclass={"build_py": BuildPyWithPth})
