"""What owns a process: the command line, the server and its cluster, benchmarks, process settings."""
