"""The errors an operator's own input raises on the silo side: unusable data (`DataError`) and a
model or task DP-SGD cannot train (`DpSgdError`). They live apart from the data pipeline and the
DP trainer so that the command line can catch them without loading pandas or Opacus: the
coordinator's process never needs either."""

from __future__ import annotations

# Stands, in a DataError's message, for the key path of the data section: `data` in a policy
# and in silo.yaml, `data.source` in silo.yaml's old nested shape; so a message names the key to
# change as the reader's file spells it.
SECTION = "<data>"


class DataError(ValueError):
    """Data that cannot make a consortium; the message names the file, column or silo, and the
    key to change (written `<data>.key`, rendered under `section`)."""

    def __init__(self, message: str, section: str = "data") -> None:
        self.template = message
        super().__init__(message.replace(SECTION, section))

    def within(self, section: str) -> DataError:
        """The same error naming keys as spelled under `section` (silo.yaml's old nested
        shape: `data.source`)."""
        return type(self)(self.template, section)


class DataNotHere(DataError):
    """Data this machine does not hold: a file that is not here, or a data plug-in that is not
    installed here (a deployment's policy names what each site holds)."""


class DpSgdError(ValueError):
    """A model or task that cannot be trained with DP-SGD; the message says why and the fix."""
