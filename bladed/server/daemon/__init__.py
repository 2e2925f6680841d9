"""The daemon wing: the process (``main``: arguments, logging, exit statuses), the composition root
(``core.Daemon``: owns the device, the region, the socket, the connections, signals and reporting),
start-up (``lifecycle``: open the device and reclaim what a crashed instance left; ``preflight``:
``--check-config``), systemd integration and the Prometheus exporter.  Nothing below imports it."""
