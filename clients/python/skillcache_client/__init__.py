"""Python client for the skillcache service: sync and async clients, the skill-file parser, a CLI."""

from ._protocol import DEFAULT_URL
from .client import AsyncSkillcacheClient, SkillcacheClient
from .errors import SkillcacheError
from .skillfile import SkillFileError, iter_skill_files, parse_skill_file, parse_skill_text

__version__ = "0.1.0"
__all__ = [
    "DEFAULT_URL",
    "AsyncSkillcacheClient",
    "SkillcacheClient",
    "SkillcacheError",
    "SkillFileError",
    "iter_skill_files",
    "parse_skill_file",
    "parse_skill_text",
]
