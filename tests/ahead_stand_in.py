"""A stand-in for precompile.AheadCompile (the second compiling process) in tests: what
warm_up, the training loop and the CLI ask of it, recorded."""


class AheadStandIn:
    def __init__(self, failure=None, running_polls=0):
        self.failure = failure  # what AheadCompile.failure says after a wait (None: it finished)
        self.running_polls = running_polls  # how many polls find it still running before it ends
        self.polls = 0
        self.waited = self.stopped = False

    def poll(self):
        self.polls += 1
        return None if self.polls <= self.running_polls else self.wait()

    def wait(self):
        self.waited = True
        return self.failure is None

    def stop(self):
        self.stopped = True
