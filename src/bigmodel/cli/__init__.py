"""The ``bigmodel`` command line: ``generate``, ``plan`` and ``estimate``.

argparse and formatting only; the work is done by the library (:mod:`bigmodel._hf`,
:mod:`bigmodel._summary`, :mod:`bigmodel._generate`, :mod:`bigmodel._embedded`).
"""
