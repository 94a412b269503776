"""Process plumbing: the launcher (torchrun's agent with one-line errors), process trees and their cleanup, loading
user code, and worker processes that run user code contained. It imports nothing else from spmdrl."""
