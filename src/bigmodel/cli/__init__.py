"""The ``bigmodel`` command line: ``generate``, ``plan`` and ``estimate``.

argparse and formatting only; the work is done by the library (:mod:`bigmodel.integrations.hf`,
:mod:`bigmodel.cli.summary`, :mod:`bigmodel.cli.generate`, :mod:`bigmodel.cli.embedded`).
"""
