"""A real multi-node cluster rehearsed on one Linux machine (root only).

Nodes are network namespaces with their own addresses in 198.18.0.0/15 (RFC 2544's benchmarking
range), joined by a bridge; each node's link is shaped by `tc tbf`. A Ray head runs on node 0 and
a Ray worker node on each other node, with token authentication and a custom resource `nodeI`.

    layout.py     ClusterLayout: names, addresses, rate, state dir (saved as JSON)
    netns.py      namespaces, veths, bridge, tbf; bounded `ip`/`tc` calls; node process kill
    ray_nodes.py  `ray start` head/worker inside a namespace, wait until every node has joined
    cluster_cli.py  `pdserve cluster up|down|exec|kill`

An ops tool: it imports nothing from the engine, the workers or the router.
"""
