"""capd: a local capability-router daemon for AI agents."""

__version__ = "0.1.0"
