"""qasr: streaming speech recognition for the Qwen3-ASR models.

The distribution maps the repository's top-level folders to subpackages:
`model/` -> `qasr.model`, `streaming/` -> `qasr.streaming`, `server/` -> `qasr.server`,
`client/` -> `qasr.client`, `bench/` -> `qasr.bench`.
"""

__version__ = "0.1.0"
