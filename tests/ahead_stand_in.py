"""A stand-in for precompile.AheadCompile (the second compiling process) in tests: what
warm_up and the CLI ask of it, recorded."""


class AheadStandIn:
    def __init__(self, failure=None):
        self.failure = failure  # what AheadCompile.failure says after a wait (None: it finished)
        self.waited = self.stopped = False

    def wait(self):
        self.waited = True
        return self.failure is None

    def stop(self):
        self.stopped = True
