"""The type aliases of memprof's torch-free layers: JSON values, as a trace file holds them and as record parts
write them, and the few values that are truly of any type.

``JSON`` is any value :func:`json.loads` can return; a record part's ``to_dict`` gives a ``JSONObject``.
A value read from a file is typed ``object`` until a check in :mod:`.checks` has narrowed it: the file may hold
anything, and only the checks decide what it is.

The ``Any`` aliases below are the only ``Any`` of the torch-free layers (record, analyse, render, report), each
for its one reason: a plain setting (``Setting``), an object of a layer above (``Above``), a user's object
(``UserObject``), an optional import's object (``Drawing``, ``Cell``), an argument a facade passes on
(``Forwarded``), a random generator's state (``Generators``) and a name a package loads on first use
(``LazyName``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["JSON", "JSONObject", "Setting", "Above", "UserObject", "Drawing", "Cell", "Forwarded", "Generators",
           "LazyName"]

JSON = dict[str, "JSON"] | list["JSON"] | str | int | float | bool | None
JSONObject = dict[str, JSON]

#: A plain setting of a module, an optimizer or a cache spec (:func:`memprof.record.specs.plain_config`): a number,
#: string, bool, None or a tuple of them. Any: the formula that reads a setting knows its type from its name
#: (``p`` a float, ``normalized_shape`` a tuple); a union would make each one narrow what it already knows. Not a
#: Union either where a field holds it: fields.py would read the union as a field's form to write.
Setting = Any

#: An object of a class from a layer above the module that takes it (a GpuSpec that record holds, a Report that
#: analyse is given), which that module cannot import (imports run one way, tests/unit/test_layout.py): the
#: docstring where it is used names its class.
Above = Any

#: A user's object of any type (a tensor of any subclass, a module's attribute), read by duck typing: record
#: imports no torch, and what it reads of the object is checked where it is read.
UserObject = Any

#: A matplotlib Axes or Figure: matplotlib is an optional import, which mypy is not given (pyproject.toml's
#: ignore_missing_imports), so its classes are Any to it whatever they are named here.
Drawing = Any

#: A cell of a pandas DataFrame (a number, a string, NaN, pandas' NA ...): pandas is an optional import, which mypy
#: is not given either.
Cell = Any

#: An argument a public function of the facade passes on unchanged to the function that does the work
#: (:func:`memprof.report.wrap.same_as`'s ``wrapped``), which checks it and whose signature ``help()`` shows: the
#: wrapper neither reads nor narrows it. (The pytest plugin's budget markers pass theirs on so too.)
Forwarded = Any

#: A generator's state, given back as it was read (:mod:`memprof.report.random_state`): Python's (a tuple), numpy's
#: and torch's, those two reached through sys.modules (a module there is any module to mypy), so Any whatever it is
#: named here.
Generators = Any

#: What a package's module ``__getattr__`` loads on first use (``memprof.profile``, ``memprof.report.Estimate``):
#: each name of its own type (a function, a class, a module), which the package's ``TYPE_CHECKING`` imports give
#: mypy; the ``__getattr__`` itself returns whichever was asked for.
LazyName = Any
