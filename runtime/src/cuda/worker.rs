//! The GPU thread ([`Worker`]): owns the context, streams, device memory, modules and graphs; captures a variant's
//! graph on first use, replays it, reads and writes buffers and slot state, and times graphs for the benchmarks.

use super::*;

/// Copies of one node per benchmark graph (`CudaBackend::bench`).
const NODE_REPEATS: u32 = 20;
/// The least bytes one [`CudaBackend::read_floor`] graph reads (several times the H200's 50 MB of L2).
pub const READ_FLOOR_SPAN: u64 = 256 << 20;

/// Everything the GPU thread owns.
pub(super) struct Worker {
    body: Arc<PlanBody>,
    // Field order matters for drop: graphs, then memory, then modules, stream and context.
    graphs: HashMap<usize, Graph>,
    #[allow(dead_code)] // held for its allocation (weight_ptr points into it)
    weights: Option<DevBuf>,
    /// Bytes of `weights`.
    weights_bytes: u64,
    weight_ptr: Vec<u64>,
    /// Whether each weight is held as MXFP8 tiles (weights.rs `tile_mxfp8`) rather than BF16.
    weight_mxfp8: Vec<bool>,
    arena: DevBuf,
    io: BTreeMap<IoBuf, DevBuf>,
    slots: DevBuf,
    desc: DevBuf,
    scratch: DevBuf,
    /// The side branch's scratch (`launch::side_scratch_elems`: the most any shared expert, linear or PLE embedding
    /// of any variant needs); `None` when the plans have none of those nodes.
    side_scratch: Option<DevBuf>,
    /// The side arena (`launch::side_arena_elems`): the PLE branch's buffers; `None` without a PLE branch.
    side_arena: Option<DevBuf>,
    /// Node counters (`launch::Addrs::counters`): one zeroed u32 per node of every variant, variant i's from
    /// `counter_base[i]`.
    #[allow(dead_code)] // held for its allocation (counter_base points into it)
    counters: DevBuf,
    counter_base: Vec<u64>,
    rope: DevBuf,
    staging: Pinned,
    funcs: HashMap<String, sys::CUfunction>,
    /// Launch kernels as programmatic dependent launches (`FLASHPLAN_PDL`, default on).
    pdl: bool,
    /// Streaming multiprocessors the one-wave grids are sized for (`launch::Addrs::sms`): the GPU's own count
    /// unless a test set another ([`CudaBackend::set_grid_sms`]).
    sms: u32,
    /// Streaming multiprocessors of the GPU.
    device_sms: u32,
    /// Blocks of a grid-barrier kernel that this GPU holds at once (`launch::Addrs::barrier_blocks`).
    barrier_blocks: u32,
    /// Blocks of `experts_one` that this GPU holds at once (`launch::Addrs::experts_one_blocks`).
    experts_one_blocks: u32,
    /// Launch runs of sibling linears as one `linear_multi` (`FLASHPLAN_FUSE_LINEAR`, default on).
    fuse_linear: bool,
    /// Fewer launches for small ops (`FLASHPLAN_FUSE_SMALL`, default on; `settings::fuse_small_setting` lists
    /// them): the router in one launch up to 8 rows, `hc_norm` inside the preceding write, the rest of a
    /// hyper-connection read in one launch up to 4 rows, one row's experts in one launch, a copy inside its norm.
    fuse_small: bool,
    modules: Vec<sys::CUmodule>,
    rope_cfg: Rope,
    /// Fork and join of the side branch during capture (`launch::LaunchSpec::side`).
    fork: Event,
    join: Event,
    side: Arc<CudaStream>,
    /// The prefetch branch (`launch::LaunchSpec::prefetch`): its stream, its fork and its one join at the end of
    /// a graph.
    prefetch: Arc<CudaStream>,
    prefetch_fork: Event,
    prefetch_join: Event,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Graphs first (their Drop destroys them), before the memory and modules they use.
        self.graphs.clear();
        for m in self.modules.drain(..) {
            // SAFETY: loaded once, unloaded once, after every graph using it is gone.
            let _ = unsafe { result::module::unload(m) };
        }
    }
}

impl Worker {
    pub(super) fn new(
        body: Arc<PlanBody>,
        weights: Vec<Option<weights::DevWeight>>,
        want: (i32, i32),
    ) -> Result<Worker, BackendError> {
        let pdl = pdl_setting()?;
        let fuse_linear = fuse_linear_setting()?;
        let fuse_small = fuse_small_setting()?;
        let ctx = CudaContext::new(0).map_err(dev_err("CUDA context"))?;
        ctx.bind_to_thread().map_err(dev_err("bind context"))?;
        // SAFETY: this backend never uses cudarc's tracked slices, only raw allocations.
        unsafe { ctx.disable_event_tracking() };
        let cc = ctx
            .compute_capability()
            .map_err(dev_err("compute capability"))?;
        if cc != want {
            return Err(BackendError::Device(format!(
                "plan mismatch: the plan is for {} but this GPU is sm_{}{}; recompile the plans for this GPU",
                body.options.arch, cc.0, cc.1
            )));
        }
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(dev_err("SM count"))?
            .max(0) as u32;
        let stream = ctx.new_stream().map_err(dev_err("stream"))?;
        let side = ctx.new_stream().map_err(dev_err("stream"))?;
        let (fork, join) = (Event::untimed()?, Event::untimed()?);
        let prefetch = ctx.new_stream().map_err(dev_err("stream"))?;
        let (prefetch_fork, prefetch_join) = (Event::untimed()?, Event::untimed()?);
        // Modules and functions.
        let mut modules = Vec::new();
        let mut funcs = HashMap::new();
        for m in &body.kernels {
            // SAFETY: the image is a cubin produced by NVRTC for this arch; it outlives the call.
            let module = unsafe { result::module::load_data(m.cubin.as_ptr() as *const c_void) }
                .map_err(|e| {
                    BackendError::Device(format!("loading kernel module {}: {e}", m.name))
                })?;
            modules.push(module);
            for e in &m.entry_points {
                let name = std::ffi::CString::new(e.as_str()).expect("entry point name");
                // SAFETY: module is loaded.
                let f = unsafe { result::module::get_function(module, name) }
                    .map_err(|err| BackendError::Device(format!("kernel {e}: {err}")))?;
                funcs.insert(e.clone(), f);
            }
        }
        let barrier_blocks = resident_blocks(&funcs, launch::BARRIER_KERNELS, sms)?;
        let experts_one_blocks = resident_blocks(&funcs, &["experts_one"], sms)?;
        // Weights, BF16 or MXFP8 (weights.rs), 256-byte aligned each.
        let (offsets, total) = weights::place(&weights);
        let wbuf = if total > 0 {
            Some(DevBuf::new(total)?)
        } else {
            None
        };
        let mut weight_ptr = vec![0u64; weights.len()];
        let mut weight_mxfp8 = vec![false; weights.len()];
        if let Some(wb) = &wbuf {
            for (i, (w, at)) in weights.iter().zip(&offsets).enumerate() {
                if let (Some(w), Some(at)) = (w, at) {
                    for (off, b) in w.pieces() {
                        let dst = wb.ptr + (at.data + off) as u64;
                        // SAFETY: dst..dst+len lies inside the allocation (weights::place sized it).
                        unsafe { result::memcpy_htod_sync(dst, b) }
                            .map_err(dev_err("weight upload"))?;
                    }
                    weight_ptr[i] = wb.ptr + at.data as u64;
                    weight_mxfp8[i] = at.mxfp8;
                }
            }
        }
        drop(weights);
        let arena = DevBuf::new(body.arena_elems as usize * 4)?;
        let mut io = BTreeMap::new();
        let mut max_io = 0usize;
        for b in IO_BUFS {
            let bytes = body.io.elems(b, &body.config) as usize * 4;
            max_io = max_io.max(bytes);
            io.insert(b, DevBuf::new(bytes)?);
        }
        let slot_bytes = body.state.slot_elems as usize * 4;
        let slots = DevBuf::new(slot_bytes * body.state.slots as usize)?;
        let desc_bytes = body.io.max_streams as usize * std::mem::size_of::<FpStream>()
            + body.io.max_rows as usize * 4;
        let desc = DevBuf::new(desc_bytes)?;
        let (mut scratch, mut side_elems) = (0u64, 0u64);
        for v in &body.variants {
            let (s, w) = v.kind.shape();
            for n in &v.nodes {
                scratch = scratch.max(launch::scratch_elems(&body, &n.op, (s * w) as u64));
                side_elems =
                    side_elems.max(launch::side_scratch_elems(&body, &n.op, (s * w) as u64));
            }
        }
        let scratch = DevBuf::new(scratch as usize * 4)?;
        let side_scratch = match side_elems {
            0 => None,
            n => Some(DevBuf::new(n as usize * 4)?),
        };
        let side_arena = match body.variants.iter().map(launch::side_arena_elems).max() {
            None | Some(0) => None,
            Some(n) => Some(DevBuf::new(n as usize * 4)?),
        };
        // launch::NODE_COUNTERS u32 counters per node of every variant, zeroed here (before any graph is captured);
        // the kernels that count in theirs leave them ready for the next launch (launch::Addrs::counters).
        let mut counter_base = Vec::with_capacity(body.variants.len());
        let mut counter_elems = 0usize;
        for v in &body.variants {
            counter_base.push(counter_elems as u64 * 4);
            counter_elems += v.nodes.len() * launch::NODE_COUNTERS as usize;
        }
        let counters = DevBuf::new(counter_elems.max(1) * 4)?;
        for b in &mut counter_base {
            *b += counters.ptr;
        }
        let rope_cfg = Rope::new(&body.config);
        let rope = DevBuf::new(rope_cfg.inv_freq.len() * 4)?;
        // SAFETY: inside the allocation.
        unsafe { result::memcpy_htod_sync(rope.ptr, rope_cfg.inv_freq.as_slice()) }
            .map_err(dev_err("rope upload"))?;
        let staging = Pinned::new(max_io.max(slot_bytes).max(desc_bytes))?;
        Ok(Worker {
            body,
            graphs: HashMap::new(),
            weights: wbuf,
            weights_bytes: total as u64,
            weight_ptr,
            weight_mxfp8,
            arena,
            io,
            slots,
            desc,
            scratch,
            side_scratch,
            side_arena,
            counters,
            counter_base,
            rope,
            staging,
            funcs,
            pdl,
            sms,
            device_sms: sms,
            barrier_blocks,
            experts_one_blocks,
            fuse_linear,
            fuse_small,
            modules,
            rope_cfg,
            fork,
            join,
            side,
            prefetch,
            prefetch_fork,
            prefetch_join,
            stream,
            ctx,
        })
    }

    pub(super) fn serve(&mut self, rx: Receiver<Cmd>) {
        if let Err(e) = self.ctx.bind_to_thread() {
            tracing::error!("GPU thread: {e}");
        }
        while let Ok(cmd) = rx.recv() {
            match cmd {
                Cmd::Run(i, d, tx) => {
                    let _ = tx.send(self.run(i, &d));
                }
                Cmd::Fetch(b, tx) => {
                    let _ = tx.send(self.fetch(b));
                }
                Cmd::Write(b, off, data, tx) => {
                    let _ = tx.send(self.write(b, off, &data));
                }
                Cmd::SetSlot(s, data, tx) => {
                    let _ = tx.send(self.set_slot(s, &data));
                }
                Cmd::GetSlot(s, tx) => {
                    let _ = tx.send(self.get_slot(s));
                }
                Cmd::ReadBuf(i, b, tx) => {
                    let _ = tx.send(self.read_buf(i, b));
                }
                Cmd::Bench(i, d, iters, tx) => {
                    let _ = tx.send(self.bench(i, &d, iters));
                }
                Cmd::Replays(i, d, iters, tx) => {
                    let _ = tx.send(self.replays(i, &d, iters));
                }
                Cmd::Prefixes(i, d, iters, tx) => {
                    let _ = tx.send(self.prefixes(i, &d, iters));
                }
                Cmd::ReadFloor(sizes, tx) => {
                    let _ = tx.send(self.read_floor(&sizes));
                }
                Cmd::GridSms(sms, tx) => {
                    self.sms = if sms == 0 { self.device_sms } else { sms };
                    self.graphs.clear();
                    let _ = tx.send(Ok(()));
                }
                Cmd::Switch(which, on, tx) => {
                    let flag = match which {
                        Switch::Pdl => &mut self.pdl,
                        Switch::FuseLinear => &mut self.fuse_linear,
                        Switch::FuseSmall => &mut self.fuse_small,
                    };
                    let was = std::mem::replace(flag, on);
                    self.graphs.clear();
                    let _ = tx.send(Ok(was));
                }
            }
        }
    }

    fn cu(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    fn sync(&self) -> Result<(), BackendError> {
        // SAFETY: the stream is valid.
        unsafe { result::stream::synchronize(self.cu()) }.map_err(dev_err("kernel execution"))
    }

    /// Launch specs of variant `i`, one entry per node (`launch::specs`: `None` for a node whose work another node's
    /// launch does).
    fn specs(&self, i: usize) -> Result<Vec<Option<launch::LaunchSpec>>, BackendError> {
        let v = &self.body.variants[i];
        let (s, w) = v.kind.shape();
        let ms = self.body.io.max_streams as u64;
        let common = FpCommon {
            streams: self.desc.ptr,
            tokens: self.desc.ptr + ms * std::mem::size_of::<FpStream>() as u64,
            slots: self.slots.ptr,
            scratch: self.scratch.ptr,
            slot_elems: self.body.state.slot_elems,
            nstreams: s,
            window: w,
        };
        let io_ptr = |b: IoBuf| self.io.get(&b).map_or(0, |d| d.ptr);
        let a = launch::Addrs {
            body: &self.body,
            arena: self.arena.ptr,
            io: &io_ptr,
            weights: &self.weight_ptr,
            mxfp8: &self.weight_mxfp8,
            common,
            rope: self.rope.ptr,
            rope_cfg: &self.rope_cfg,
            counters: self.counter_base[i],
            fuse_small: self.fuse_small,
            sms: self.sms,
            barrier_blocks: self.barrier_blocks,
            experts_one_blocks: self.experts_one_blocks,
            side_scratch: self.side_scratch.as_ref().map_or(0, |b| b.ptr),
            side_arena: self.side_arena.as_ref().map_or(0, |b| b.ptr),
            prefetch_budget: launch::prefetch_budget(v.kind),
            moved: &[],
        };
        launch::specs(&a, v, self.fuse_linear)
    }

    /// The launches of `sp` on the main stream; with `branches`, its side launches on the side stream (forked
    /// here; a later spec's `join_before` joins them: `launch::LaunchSpec`), else in line before its own. Graph capture
    /// only (a wait on the join event outside a capture would wait for a stale record).
    fn launch(&self, sp: &launch::LaunchSpec, branches: bool) -> Result<(), BackendError> {
        let (main, side) = (self.cu(), self.side.cu_stream());
        if branches && !sp.prefetch.is_empty() {
            let pf = self.prefetch.cu_stream();
            // SAFETY: events and streams are valid; the prefetch stream is in this capture from here on.
            unsafe { follow(&self.prefetch_fork, main, pf, "fork") }?;
            for s in &sp.prefetch {
                self.launch_on(s, pf, false, None)?;
            }
        }
        if !sp.side.is_empty() {
            if branches {
                // SAFETY: events and streams are valid; both streams are in this capture from here on.
                unsafe { follow(&self.fork, main, side, "fork") }?;
                for s in &sp.side {
                    self.launch_on(s, side, false, None)?;
                }
                // SAFETY: as above.
                unsafe { result::event::record(self.join.0, side) }.map_err(dev_err("join"))?;
            } else {
                for s in &sp.side {
                    self.launch_on(s, main, self.pdl, None)?;
                }
            }
        }
        let join = if branches { sp.join_before } else { None };
        self.launch_on(sp, main, self.pdl, join)
    }

    /// Every launch of `sp` (not its side launches) on `stream`, with `pdl` as programmatic dependent launches;
    /// `join`: before that launch (0: the kernel, `k`: `then[k - 1]`) the stream waits for the side branch's join
    /// event, and that launch is a plain one.
    fn launch_on(
        &self,
        sp: &launch::LaunchSpec,
        stream: sys::CUstream,
        pdl: bool,
        join: Option<usize>,
    ) -> Result<(), BackendError> {
        let mut params = sp.params.clone();
        let mut args = [params.as_mut_ptr() as *mut c_void];
        let launches = std::iter::once((sp.kernel, sp.grid, sp.block))
            .chain(sp.then.iter().map(|&(k, g, b)| (k, g, (b, 1, 1))));
        for (n, (kernel, grid, block)) in launches.enumerate() {
            let joins = join == Some(n);
            if joins {
                // SAFETY: the join event was recorded on the side stream in this capture.
                unsafe {
                    result::stream::wait_event(
                        stream,
                        self.join.0,
                        sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    )
                }
                .map_err(dev_err("join"))?;
            }
            self.launch_one(kernel, grid, block, &mut args, stream, pdl && !joins)?;
        }
        Ok(())
    }

    /// One kernel launch on `stream`; with `pdl` as a programmatic dependent launch (the kernel may be
    /// scheduled while the previous one finishes; every kernel waits for it in `pdl_start`, `kernels/common.cuh`).
    fn launch_one(
        &self,
        kernel: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &mut [*mut c_void; 1],
        stream: sys::CUstream,
        pdl: bool,
    ) -> Result<(), BackendError> {
        let f = *self.funcs.get(kernel).ok_or_else(|| {
            BackendError::Device(format!("the plan's kernels have no entry point `{kernel}`"))
        })?;
        let mut attr = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            // SAFETY: an all-zero union is a valid value; the field used is set next.
            value: unsafe { std::mem::zeroed() },
        };
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: 0,
            hStream: stream,
            attrs: &mut attr,
            numAttrs: u32::from(pdl),
        };
        // SAFETY: the function takes one parameter struct by value whose bytes `args[0]` points to; every address in
        // it points into this worker's allocations, which outlive the launch (and every graph). `config` and `attr`
        // live across the call.
        unsafe { sys::cuLaunchKernelEx(&config, f, args.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .map_err(|e| BackendError::Device(format!("launching {kernel}: {e}")))
    }

    fn capture(&mut self, i: usize) -> Result<Option<CaptureInfo>, BackendError> {
        if self.graphs.contains_key(&i) {
            return Ok(None);
        }
        let t0 = Instant::now();
        let specs = self.specs(i)?;
        let g = self.capture_graph(specs.iter().flatten(), true)?;
        self.graphs.insert(i, g);
        Ok(Some(CaptureInfo {
            variant: self.body.variants[i].kind.name(),
            nodes: specs.iter().flatten().map(|s| s.launches()).sum(),
            ms: t0.elapsed().as_secs_f64() * 1e3,
        }))
    }

    fn upload_desc(&self, d: &[u8]) -> Result<(), BackendError> {
        // SAFETY: the staging buffer is larger than the descriptor and not in use (every command ends synchronised).
        unsafe {
            std::ptr::copy_nonoverlapping(d.as_ptr(), self.staging.ptr, d.len());
            let src = std::slice::from_raw_parts(self.staging.ptr, d.len());
            result::memcpy_htod_async(self.desc.ptr, src, self.cu())
        }
        .map_err(dev_err("descriptor upload"))
    }

    fn replay(&self, i: usize) -> Result<(), BackendError> {
        let g = &self.graphs[&i];
        // SAFETY: an instantiated graph on our stream.
        unsafe { result::graph::launch(g.exec, self.cu()) }.map_err(dev_err("graph launch"))
    }

    fn run(&mut self, i: usize, d: &[u8]) -> Result<Option<CaptureInfo>, BackendError> {
        let info = self.capture(i)?;
        self.upload_desc(d)?;
        self.replay(i)?;
        self.sync()?;
        Ok(info)
    }

    fn fetch(&self, b: IoBuf) -> Result<Vec<f32>, BackendError> {
        let buf = &self.io[&b];
        let elems = self.body.io.elems(b, &self.body.config) as usize;
        self.dtoh(buf.ptr, elems)
    }

    fn dtoh(&self, ptr: u64, elems: usize) -> Result<Vec<f32>, BackendError> {
        assert!(elems * 4 <= self.staging.bytes);
        // SAFETY: staging holds at least elems floats; synchronised before reading.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(self.staging.ptr as *mut f32, elems);
            result::memcpy_dtoh_async(dst, ptr, self.cu()).map_err(dev_err("read back"))?;
            self.sync()?;
            Ok(dst.to_vec())
        }
    }

    fn htod(&self, ptr: u64, data: &[f32]) -> Result<(), BackendError> {
        assert!(data.len() * 4 <= self.staging.bytes);
        // SAFETY: staging holds the data; synchronised before returning.
        unsafe {
            let src = std::slice::from_raw_parts_mut(self.staging.ptr as *mut f32, data.len());
            src.copy_from_slice(data);
            result::memcpy_htod_async(ptr, &*src, self.cu()).map_err(dev_err("upload"))?;
        }
        self.sync()
    }

    fn write(&self, b: IoBuf, off: usize, data: &[f32]) -> Result<(), BackendError> {
        let elems = self.body.io.elems(b, &self.body.config) as usize;
        if off + data.len() > elems {
            return Err(BackendError::BadDescriptor(format!(
                "write_io {b:?}: {} elements at {off} exceed {elems}",
                data.len()
            )));
        }
        self.htod(self.io[&b].ptr + off as u64 * 4, data)
    }

    fn slot_ptr(&self, s: u32) -> Result<u64, BackendError> {
        if s >= self.body.state.slots {
            return Err(BackendError::BadDescriptor(format!(
                "slot {s} out of range"
            )));
        }
        Ok(self.slots.ptr + s as u64 * self.body.state.slot_elems * 4)
    }

    fn read_buf(&self, i: usize, b: flashplan_plan::BufId) -> Result<Vec<f32>, BackendError> {
        let v = &self.body.variants[i];
        let d = v.buf(b);
        if self.side_arena.is_some() && launch::side_arena_buffers(v).contains(&b) {
            return Err(BackendError::BadDescriptor(format!(
                "buffer {} lives in the side arena while the graph runs (the PLE branch), not at its plan address",
                d.name
            )));
        }
        let base = match d.space {
            flashplan_plan::Space::Arena => self.arena.ptr,
            flashplan_plan::Space::Io(io) => self.io[&io].ptr,
        };
        let elems = d.elems as usize;
        if elems * 4 > self.staging.bytes {
            return Err(BackendError::BadDescriptor(format!(
                "buffer of {elems} elements is larger than the staging area"
            )));
        }
        self.dtoh(base + d.offset * 4, elems)
    }

    fn set_slot(&self, s: u32, data: &[f32]) -> Result<(), BackendError> {
        self.htod(self.slot_ptr(s)?, data)
    }

    fn get_slot(&self, s: u32) -> Result<Vec<f32>, BackendError> {
        self.dtoh(self.slot_ptr(s)?, self.body.state.slot_elems as usize)
    }

    /// A graph of `n` back-to-back launches of one node (benchmarks only; the node's side effects repeat).
    fn repeat_graph(&self, sp: &launch::LaunchSpec, n: u32) -> Result<Graph, BackendError> {
        self.capture_graph(std::iter::repeat_n(sp, n as usize), false)
    }

    /// Captures the launches of `specs`, in order, into an instantiated graph (on our stream, thread-local mode);
    /// with `branches` the side launches on the side stream (`launch::LaunchSpec::side`), else in line. A side branch
    /// still open after the last spec (a prefix of a variant's launches, [`Self::prefixes`]) joins the main stream
    /// at the end; a variant's whole list has none open.
    fn capture_graph<'s>(
        &self,
        specs: impl Iterator<Item = &'s launch::LaunchSpec>,
        branches: bool,
    ) -> Result<Graph, BackendError> {
        // SAFETY: capture on our non-default stream in thread-local mode; ended below on every path.
        unsafe {
            result::stream::begin_capture(
                self.cu(),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(dev_err("begin capture"))?;
        let mut launched = Ok(());
        let mut prefetched = false;
        let mut side_open = false;
        for sp in specs {
            prefetched |= branches && !sp.prefetch.is_empty();
            if branches && sp.join_before.is_some() {
                side_open = false;
            }
            side_open |= branches && !sp.side.is_empty();
            launched = self.launch(sp, branches);
            if launched.is_err() {
                break;
            }
        }
        if launched.is_ok() && side_open {
            // SAFETY: the join event was recorded on the side stream in this capture, after its last launch.
            launched = unsafe {
                result::stream::wait_event(
                    self.cu(),
                    self.join.0,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            }
            .map_err(dev_err("join"));
        }
        if launched.is_ok() && prefetched {
            // The prefetch branch joins the main stream once, at the end (nothing waits for it before).
            // SAFETY: the event is recorded on the prefetch stream in this capture, then waited on by ours.
            launched = unsafe {
                follow(
                    &self.prefetch_join,
                    self.prefetch.cu_stream(),
                    self.cu(),
                    "join",
                )
            };
        }
        // SAFETY: the capture begun above.
        let graph = unsafe { result::stream::end_capture(self.cu()) };
        if let Err(e) = launched {
            if let Ok(g) = graph {
                // SAFETY: the graph just captured, destroyed once.
                let _ = unsafe { result::graph::destroy(g) };
            }
            return Err(e);
        }
        let graph = graph.map_err(dev_err("end capture"))?;
        // SAFETY: graph is a valid captured graph.
        match unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
            Ok(exec) => Ok(Graph { exec, graph }),
            Err(e) => {
                // SAFETY: the graph just captured, destroyed once.
                let _ = unsafe { result::graph::destroy(graph) };
                Err(dev_err("graph instantiate")(e))
            }
        }
    }

    /// Milliseconds `f`'s work takes on the stream, between two events of `ev`.
    fn timed(
        &self,
        ev: &(Event, Event),
        f: &dyn Fn(&Self) -> Result<(), BackendError>,
    ) -> Result<f32, BackendError> {
        // SAFETY: events and stream are valid.
        unsafe {
            result::event::record(ev.0 .0, self.cu()).map_err(dev_err("event"))?;
            f(self)?;
            result::event::record(ev.1 .0, self.cu()).map_err(dev_err("event"))?;
            result::event::synchronize(ev.1 .0).map_err(dev_err("event"))?;
            result::event::elapsed(ev.0 .0, ev.1 .0).map_err(dev_err("event"))
        }
    }

    /// Median of `iters` timed replays of variant `i` with descriptor `d`, after 5 untimed ones, microseconds.
    fn replays(&mut self, i: usize, d: &[u8], iters: u32) -> Result<f64, BackendError> {
        self.capture(i)?;
        self.upload_desc(d)?;
        self.sync()?;
        let ev = (Event::new()?, Event::new()?);
        self.median_replay(&ev, &|t| t.replay(i), iters)
    }

    /// Median of `iters` timed runs of `replay` after 5 untimed ones, microseconds. Replays keep re-running the
    /// same round (state commits repeat on the same positions: the same work).
    fn median_replay(
        &self,
        ev: &(Event, Event),
        replay: &dyn Fn(&Self) -> Result<(), BackendError>,
        iters: u32,
    ) -> Result<f64, BackendError> {
        for _ in 0..5 {
            self.timed(ev, replay)?;
        }
        let mut ts: Vec<f64> = (0..iters.max(1))
            .map(|_| self.timed(ev, replay).map(|ms| ms as f64 * 1e3))
            .collect::<Result<_, _>>()?;
        ts.sort_by(|a, b| a.total_cmp(b));
        Ok(ts[ts.len() / 2])
    }

    /// [`CudaBackend::prefix_times`]: for every node k of variant `i`, the median replay of a graph of the launches
    /// of nodes 0 ..= k (captured as the variant's graph is, branches included), microseconds.
    fn prefixes(&mut self, i: usize, d: &[u8], iters: u32) -> Result<Vec<f64>, BackendError> {
        let specs = self.specs(i)?;
        self.upload_desc(d)?;
        self.sync()?;
        let ev = (Event::new()?, Event::new()?);
        let mut out = Vec::with_capacity(specs.len());
        let mut last = 0.0;
        for k in 0..specs.len() {
            if specs[k].is_some() {
                let g = self.capture_graph(specs[..=k].iter().flatten(), true)?;
                last = self.median_replay(
                    &ev,
                    &|t| {
                        // SAFETY: an instantiated graph on our stream.
                        unsafe { result::graph::launch(g.exec, t.cu()) }
                            .map_err(dev_err("graph launch"))
                    },
                    iters,
                )?;
            }
            out.push(last);
        }
        Ok(out)
    }

    /// [`CudaBackend::read_floor`].
    fn read_floor(&self, sizes: &[u64]) -> Result<Vec<f64>, BackendError> {
        let (Some(w), total) = (&self.weights, self.weights_bytes) else {
            return Err(BackendError::Device(
                "read_floor: no weights to read".into(),
            ));
        };
        let ev = (Event::new()?, Event::new()?);
        let mut out = Vec::with_capacity(sizes.len());
        for &size in sizes {
            let size = size / 256 * 256;
            if size > total {
                return Err(BackendError::Device(format!(
                    "read_floor: {size} bytes, but the weights hold {total}"
                )));
            }
            let copies = match size {
                0 => NODE_REPEATS as u64,
                _ => READ_FLOOR_SPAN.div_ceil(size).max(NODE_REPEATS as u64),
            };
            let regions = (total / size.max(1)).max(1);
            let specs: Vec<launch::LaunchSpec> = (0..copies)
                .map(|c| {
                    launch::read_floor_spec(
                        w.ptr + (c % regions) * size,
                        size,
                        self.scratch.ptr,
                        self.sms,
                    )
                })
                .collect();
            let g = self.capture_graph(specs.iter(), false)?;
            out.push(self.best_per_copy(&ev, &g, copies)?);
        }
        Ok(out)
    }

    /// Microseconds per copy of a graph of `copies` back-to-back copies of one launch: the best of three replays
    /// (the node times of [`Self::bench`], [`Self::read_floor`]).
    fn best_per_copy(
        &self,
        ev: &(Event, Event),
        g: &Graph,
        copies: u64,
    ) -> Result<f64, BackendError> {
        let mut best = f64::MAX;
        for _ in 0..3 {
            // SAFETY: an instantiated graph on our stream.
            let ms = self.timed(ev, &|t| {
                unsafe { result::graph::launch(g.exec, t.cu()) }.map_err(dev_err("graph launch"))
            })?;
            best = best.min(ms as f64 * 1e3 / copies as f64);
        }
        Ok(best)
    }

    fn bench(&mut self, i: usize, d: &[u8], iters: u32) -> Result<BenchResult, BackendError> {
        let median_us = self.replays(i, d, iters)?;
        let ev = (Event::new()?, Event::new()?);
        let specs = self.specs(i)?;
        let mut per: BTreeMap<String, f64> = BTreeMap::new();
        let mut nodes_us = Vec::with_capacity(specs.len());
        for sp in &specs {
            // A node without a launch costs nothing of its own: fused into another node's launch (a linear run's
            // first node, or the norm after an embed or gather: that launch's time stands at its own node), or a
            // window-1 gdn_commit done by gdn_conv and gdn_recur_one.
            let Some(sp) = sp else {
                nodes_us.push(0.0);
                continue;
            };
            // The node's cost inside a graph: a graph of NODE_REPEATS back-to-back copies of it, replayed; the time
            // per copy includes the in-graph launch gap, as in the variant's own graph. Side launches run in line
            // here; their own time goes to their kernel.
            let node_us = |sp: &launch::LaunchSpec| -> Result<f64, BackendError> {
                let g = self.repeat_graph(sp, NODE_REPEATS)?;
                self.best_per_copy(&ev, &g, NODE_REPEATS as u64)
            };
            let best = node_us(sp)?;
            let mut side_us = 0.0;
            for side in &sp.side {
                let t = node_us(side)?;
                *per.entry(side.name()).or_default() += t;
                side_us += t;
            }
            *per.entry(sp.name()).or_default() += (best - side_us).max(0.0);
            nodes_us.push(best);
        }
        let mut kernels_us: Vec<(String, f64)> = per.into_iter().collect();
        kernels_us.sort_by(|a, b| b.1.total_cmp(&a.1));
        Ok(BenchResult {
            median_us,
            kernels_us,
            nodes_us,
        })
    }
}

/// Makes `to` wait for the work enqueued on `from` so far: records `event` on `from`, then `to` waits on it (a fork
/// or a join of a graph branch during capture). `what` names the step in errors.
///
/// # Safety
/// `event`, `from` and `to` must be valid, and in a capture both streams take part in it.
unsafe fn follow(
    event: &Event,
    from: sys::CUstream,
    to: sys::CUstream,
    what: &'static str,
) -> Result<(), BackendError> {
    // SAFETY: as the caller promises.
    unsafe {
        result::event::record(event.0, from).map_err(dev_err(what))?;
        result::stream::wait_event(to, event.0, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
            .map_err(dev_err(what))
    }
}

/// Blocks of `kernels` (barrier kernels with blocks of `launch::BARRIER_BLOCK` threads: `launch::BARRIER_KERNELS`,
/// or `experts_one`) that this GPU holds at once: the least of their occupancies
/// (`cuOccupancyMaxActiveBlocksPerMultiprocessor`, from each compiled kernel's registers and shared memory) times
/// `sms`; 0 when the plan has none of them. A launch whose grid is larger could wait forever at a barrier, so the
/// launches check their grid against it (`launch::Addrs::barrier_blocks`, `launch::Addrs::experts_one_blocks`).
fn resident_blocks(
    funcs: &HashMap<String, sys::CUfunction>,
    kernels: &[&str],
    sms: u32,
) -> Result<u32, BackendError> {
    let mut per_sm: Option<u32> = None;
    for name in kernels {
        let Some(&f) = funcs.get(*name) else { continue };
        let mut n: std::ffi::c_int = 0;
        // SAFETY: f is a function of a loaded module; n is a valid out pointer.
        unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                &mut n,
                f,
                launch::BARRIER_BLOCK as i32,
                0,
            )
        }
        .result()
        .map_err(|e| BackendError::Device(format!("occupancy of {name}: {e}")))?;
        per_sm = Some(per_sm.map_or(n.max(0) as u32, |p| p.min(n.max(0) as u32)));
    }
    Ok(per_sm.unwrap_or(0) * sms)
}
