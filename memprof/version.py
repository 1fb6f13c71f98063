"""The version of memprof, which every record carries (``Trace.memprof_version``)."""

__version__ = "0.1.0"
