"""The exception a trainer's SP setup raises when this trainer instance cannot run exactly under SP.

`support.check_trainer` turns it into the `NotImplementedError` that names the trainer and what works;
the setups raise it instead of building that message themselves, so they need not import `support`.
"""


class UnsupportedSetup(Exception):
    """This trainer's model or options have no exact SP path; the message says why."""
