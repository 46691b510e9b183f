"""kvbridge on Ray Serve (the optional `kvbridge[ray]` extra): the router as the application's
ingress, prefill and decode pools whose replicas each run a kvbridge engine, discovery of the
pools' replicas through Ray, and their autoscaling policy. See app.py for where Ray ends and
kvbridge begins. Only cli.py imports this package; it may import the proxy, the server and the
launcher."""
