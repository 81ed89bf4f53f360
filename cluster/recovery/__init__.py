"""What keeps a job training at full size when nodes fail: the health gate's verdicts on each
node's facts, the ledger that remembers bad nodes across runs, and (next) the pool that picks
each attempt's nodes and the failure classes the restart policy acts on."""
