"""Process start-up and supervision: local launch, joining a torchrun world, threads, output
folders."""
