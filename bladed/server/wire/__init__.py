"""The wire wing: one thread per client connection (``connection``: JSON control requests, and binary
batched I/O on a data connection), and the C request loop that serves a data connection's ranges
without Python (``lane``).  Asks the daemon only through ``connection.Services``."""
