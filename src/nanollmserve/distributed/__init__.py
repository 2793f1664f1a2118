"""Scale-out: the tensor-parallel process group, its step broadcast and worker ranks."""
