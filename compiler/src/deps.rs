//! Node dependencies: a node depends on the last writer of every buffer it reads or writes, on every reader of a
//! buffer it overwrites since that buffer's last write, and on the last node touching any state piece it touches.

use std::collections::{BTreeSet, HashMap};

use flashplan_plan::Node;

/// Fills `deps` of every node from its buffer and state accesses.
pub fn fill_deps(nodes: &mut [Node]) {
    let mut last_writer: HashMap<u32, u32> = HashMap::new();
    let mut readers: HashMap<u32, Vec<u32>> = HashMap::new();
    let mut last_state: HashMap<u32, u32> = HashMap::new();
    for (i, node) in nodes.iter_mut().enumerate() {
        let op = &node.op;
        let mut deps = BTreeSet::new();
        for r in op.reads() {
            if let Some(w) = last_writer.get(&r.0) {
                deps.insert(*w);
            }
        }
        for w in op.writes() {
            if let Some(x) = last_writer.get(&w.0) {
                deps.insert(*x);
            }
            if let Some(rs) = readers.get(&w.0) {
                deps.extend(rs.iter().copied());
            }
        }
        for s in op.states() {
            if let Some(x) = last_state.get(&s.0) {
                deps.insert(*x);
            }
        }
        let i32_ = i as u32;
        for r in op.reads() {
            readers.entry(r.0).or_default().push(i32_);
        }
        for w in op.writes() {
            last_writer.insert(w.0, i32_);
            readers.remove(&w.0);
        }
        for s in op.states() {
            last_state.insert(s.0, i32_);
        }
        deps.remove(&i32_);
        node.deps = deps.into_iter().collect();
    }
}
