"""memprof: where does my training memory go?"""

from .categories import Category, Phase
from .errors import MemprofError, ProfilerStateError
from .units import format_bytes, parse_size

__version__ = "0.1.0"

__all__ = ["Category", "Phase", "MemprofError", "ProfilerStateError", "format_bytes", "parse_size", "__version__"]
