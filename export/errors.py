"""The error of `specrt export`: every module of the export raises it (or a head error it is made from)."""
from __future__ import annotations


class ExportError(RuntimeError):
    pass
