"""Worker groups: ranks, tensor-parallel collectives, pipeline traffic."""
