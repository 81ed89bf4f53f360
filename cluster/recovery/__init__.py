"""What keeps a job training at full size when nodes fail: the health gate's verdicts on each
node's facts, the ledger that remembers bad nodes across runs, the pool that picks each
attempt's nodes, and the failure classes (classes.py) the restart policy acts on."""
