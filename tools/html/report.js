/* heapdump HTML report: renders the JSON in #heapdump-data into the skeleton of body.html.
 * Chart.js (global Chart) draws the timeline, d3-hierarchy (global d3) lays out the icicle.
 * Plain script, no modules and no fetches: the page is a single file opened from disk. */
(function () {
  'use strict';
  const T0 = performance.now();
  const $ = (id) => document.getElementById(id);
  // Milliseconds since script start of each first-view step, for window.heapdumpReport.timings.
  const timings = {};
  const mark = (step) => { if (!(step in timings)) timings[step] = Math.round((performance.now() - T0) * 10) / 10; };

  const ROW = 18;         // icicle row height (px); .flame-node in report.css is 17px + 1px gap
  const MIN_PX = 1;       // narrower nodes are neither laid out nor put in the DOM
  const SITES_PAGE = 200; // rows drawn before "Show all": thousands of rows would slow the first view
  const STACKS_SHOWN = 10;

  // ---------- formatting ----------
  const ESC = { '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;', "'": '&#39;' };
  const esc = (s) => String(s).replace(/[&<>"']/g, (c) => ESC[c]);
  const num = (v) => (typeof v === 'number' && isFinite(v) ? v : 0);
  // Integers below 2^53 print exactly with String(); data-* attributes rely on that.
  const exact = (v) => String(num(v));
  // Thousands separators by hand: Intl.NumberFormat's first use costs ~20 ms of the first view.
  const count = (v) => {
    v = num(v);
    const s = String(Math.abs(v)), dot = s.indexOf('.'), int = dot < 0 ? s : s.slice(0, dot);
    return (v < 0 ? '-' : '') + int.replace(/\B(?=(\d{3})+$)/g, ',') + (dot < 0 ? '' : s.slice(dot));
  };
  const UNITS = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
  function bytes(v, signed) {
    v = num(v);
    let a = Math.abs(v), i = 0;
    while (a >= 1024 && i < UNITS.length - 1) { a /= 1024; i++; }
    const s = i === 0 ? String(a) : a.toFixed(a < 10 ? 2 : a < 100 ? 1 : 0);
    return (v < 0 ? '\u2212' : signed && v > 0 ? '+' : '') + s + ' ' + UNITS[i];
  }
  const signedCount = (v) => (v > 0 ? '+' : '') + count(v);
  // Human number with the exact one in the tooltip.
  const hBytes = (v, signed) => '<span title="' + count(v) + ' bytes">' + bytes(v, signed) + '</span>';
  const pct = (part, whole) => (whole > 0 ? (100 * part / whole).toFixed(part === whole ? 0 : 1) + '%' : '\u2013');
  const plural = (n, w) => count(n) + ' ' + w + (n === 1 ? '' : 's');
  const arr = (a) => (Array.isArray(a) ? a : []);

  // ---------- data ----------
  let DATA;
  try {
    DATA = JSON.parse($('heapdump-data').textContent);
  } catch (e) {
    document.body.insertAdjacentHTML('afterbegin', '<p class="warning">heapdump: the report data could not be read (' + esc(e.message) + ').</p>');
    window.heapdumpReport = { ready: false, error: String(e.message) };
    document.body.dataset.ready = 'error';
    return;
  }
  mark('parse');
  const DIFF = DATA.kind === 'diff';
  const PROCS = arr(DATA.processes);

  // Metrics of the flame graph. A diff's growth metrics clamp each stack at zero so that a
  // parent is never narrower than its children (d3.partition needs values that add up).
  const METRICS = DIFF ? [
    { key: 'delta_bytes', label: 'Growth (bytes)', src: 'delta_bytes', clamp: true, isBytes: true },
    { key: 'delta_blocks', label: 'Growth (blocks)', src: 'delta_blocks', clamp: true },
    { key: 'added_bytes', label: 'Added bytes', src: 'added_bytes', isBytes: true },
    { key: 'removed_bytes', label: 'Removed bytes', src: 'removed_bytes', isBytes: true },
  ] : [
    { key: 'live_bytes', label: 'Live bytes', src: 'live_bytes', isBytes: true },
    { key: 'live_blocks', label: 'Live blocks', src: 'live_blocks' },
    { key: 'alloc_bytes', label: 'Allocated bytes', src: 'alloc_bytes', isBytes: true },
    { key: 'alloc_blocks', label: 'Allocated blocks', src: 'alloc_blocks' },
    { key: 'temp_blocks', label: 'Temporary blocks', src: 'temp_blocks' },
    { key: 'peak_bytes', label: 'Bytes at peak', src: 'peak_bytes', isBytes: true },
  ];
  const METRIC = {};
  METRICS.forEach((m) => { METRIC[m.key] = m; });
  // Unclamped sums the tree also keeps: a diff node's net change (colour, tooltip).
  const EXTRA = DIFF ? [{ key: 'net_bytes', src: 'delta_bytes' }, { key: 'net_blocks', src: 'delta_blocks' }] : [];

  const SITE_COLS = DIFF ? [
    { key: 'name', label: 'Site' },
    { key: 'delta_bytes', label: 'Net bytes', fmt: 'sbytes' },
    { key: 'delta_blocks', label: 'Net blocks', fmt: 'scount' },
    { key: 'added_bytes', label: 'Added bytes', fmt: 'bytes' },
    { key: 'removed_bytes', label: 'Removed bytes', fmt: 'bytes' },
  ] : [
    { key: 'name', label: 'Site' },
    { key: 'live_bytes', label: 'Live bytes', fmt: 'bytes' },
    { key: 'live_blocks', label: 'Live blocks', fmt: 'count' },
    { key: 'alloc_bytes', label: 'Allocated bytes', fmt: 'bytes' },
    { key: 'alloc_blocks', label: 'Allocated blocks', fmt: 'count' },
    { key: 'temp_blocks', label: 'Temporary blocks', fmt: 'count' },
    { key: 'peak_bytes', label: 'Bytes at peak', fmt: 'bytes' },
  ];
  const LEAK_CATS = ['definitely_lost', 'indirectly_lost', 'possibly_lost', 'still_reachable'];
  const catWords = (c) => String(c).replace('_', ' ');

  // `heapdump report --sort`: what the flame graph and the sites table show first.
  const FIRST = { allocated: 'alloc_bytes', temporary: 'temp_blocks', peak: 'peak_bytes' }[DATA.sort];
  const state = {
    proc: -1, P: null, metric: FIRST || METRICS[0].key, zoom: 0, search: '',
    sort: { key: FIRST || null, desc: true }, sitesAll: false, expandedSites: new Set(), expandedLeaks: new Set(),
  };
  const prepared = [];
  let chart = null;

  // ---------- the call tree ----------
  // Stacks merge into a prefix tree over function indices. Sorting the root-first frame lists
  // lexicographically makes every shared prefix contiguous, so one pass creates the nodes in
  // preorder with no per-node maps: node i's subtree is [i, end[i]), its first child is i+1,
  // a child c's next sibling is end[c]. Flat typed arrays keep 10^6 nodes cheap.
  function buildTree(p) {
    const nf = p.functions.length, stacks = p.stacks, n = stacks.length;
    const frames = new Array(n);
    let cap = 1;
    for (let s = 0; s < n; s++) {
      const f = stacks[s] && Array.isArray(stacks[s].frames) ? stacks[s].frames : [];
      frames[s] = f;
      cap += f.length;
    }
    const order = new Int32Array(n);
    for (let s = 0; s < n; s++) order[s] = s;
    order.sort((a, b) => {
      const fa = frames[a], fb = frames[b], l = Math.min(fa.length, fb.length);
      for (let k = 0; k < l; k++) if (fa[k] !== fb[k]) return fa[k] - fb[k];
      return fa.length - fb.length;
    });
    const parent = new Int32Array(cap), fn = new Int32Array(cap), depth = new Int32Array(cap), end = new Int32Array(cap);
    // A node's source line: where its function was in the stacks through it (each stack's
    // `lines`, parallel to its frames), or -1 where they disagree (it called on from several
    // lines), 0 where unknown.
    const line = new Int32Array(cap);
    const lineAt = (s, d) => { const l = stacks[s] && stacks[s].lines; return Array.isArray(l) && l[d] > 0 ? l[d] : 0; };
    const leafOf = new Int32Array(n);
    parent[0] = -1; fn[0] = -1;
    const path = [0];
    let prev = [], cnt = 1;
    for (let o = 0; o < n; o++) {
      const s = order[o], f = frames[s];
      let c = 0;
      while (c < f.length && c < prev.length && f[c] === prev[c]) c++;
      for (let d = prev.length; d > c; d--) end[path[d]] = cnt;
      for (let d = 0; d < c; d++) if (line[path[d + 1]] !== lineAt(s, d)) line[path[d + 1]] = -1;
      for (let d = c; d < f.length; d++) {
        const x = f[d];
        parent[cnt] = path[d]; fn[cnt] = x >= 0 && x < nf ? x : -1; depth[cnt] = d + 1; line[cnt] = lineAt(s, d); path[d + 1] = cnt++;
      }
      leafOf[s] = path[f.length];
      prev = f;
    }
    for (let d = prev.length; d >= 0; d--) end[path[d]] = cnt;
    // Each metric's node values are summed when first asked for (the first view needs one or
    // two): each stack's value at its leaf, then, children coming after their parent in
    // preorder, one backward pass adds every subtree into its parent.
    const sum = (m) => {
      const v = new Float64Array(cnt), src = m.src, clamp = !!m.clamp;
      for (let o = 0; o < n; o++) { // in tree order: the writes to v go forward through memory
        const s = order[o], x = stacks[s] ? stacks[s][src] : 0;
        if (typeof x === 'number' && isFinite(x) && (x > 0 || !clamp)) v[leafOf[s]] += x;
      }
      for (let i = cnt - 1; i > 0; i--) v[parent[i]] += v[i];
      return v;
    };
    const vals = {};
    METRICS.concat(EXTRA).forEach((m) => {
      let v = null;
      Object.defineProperty(vals, m.key, { enumerable: true, get: () => v || (v = sum(m)) });
    });
    return { count: cnt, parent, fn, depth, end, line, vals };
  }

  // Per-process data, built on first view of the process.
  function prepare(i) {
    if (prepared[i]) return prepared[i];
    const raw = PROCS[i] || {};
    const p = Object.assign({}, raw, {
      functions: arr(raw.functions), stacks: arr(raw.stacks), sites: arr(raw.sites),
    });
    const P = { p, tree: buildTree(p), lower: null, colors: null, legend: null };
    mark('tree');
    assignColors(P);
    prepared[i] = P;
    return P;
  }

  const fnOf = (P, k) => (k >= 0 && P.p.functions[k]) || null;
  const fnName = (P, k) => { const f = fnOf(P, k); return f && f.name != null ? String(f.name) : '?'; };
  const nodeName = (P, i) => (i === 0 ? 'all' : fnName(P, P.tree.fn[i]));
  const loc = (o) => (o && o.file ? o.file + (o.line ? ':' + o.line : '') : '');
  // Where a function was in one stack: its file, and the stack's own line for that frame.
  const locAt = (f, line) => (f && f.file ? f.file + (line > 0 ? ':' + line : '') : '');
  // Where a flame graph node's function was: one line, or several (it called on from each).
  const nodeLoc = (P, i) => {
    const f = fnOf(P, P.tree.fn[i]), l = P.tree.line[i];
    return f && f.file ? f.file + (l > 0 ? ':' + l : l < 0 ? ' (several lines)' : '') : '';
  };

  // ---------- colours ----------
  function hash(s) {
    let h = 2166136261;
    for (let i = 0; i < s.length; i++) { h ^= s.charCodeAt(i); h = Math.imul(h, 16777619); }
    return h >>> 0;
  }
  // The program's own module gets the warm flame palette, each library a hue family of its
  // own, so that where the program ends and its libraries begin shows at a glance.
  const FAMILIES = [195, 120, 270, 330, 75, 225, 160, 300];
  function assignColors(P) {
    const fns = P.p.functions, freq = new Map();
    fns.forEach((f) => { const m = (f && f.module) || ''; freq.set(m, (freq.get(m) || 0) + 1); });
    const mods = Array.from(freq.keys()).sort((a, b) => freq.get(b) - freq.get(a) || (a < b ? -1 : 1));
    const main = freq.has(P.p.name) ? P.p.name : mods.find((m) => m) || '';
    const base = new Map();
    let k = 0;
    mods.forEach((m) => { base.set(m, m === main ? -1 : m === '' ? -2 : FAMILIES[k++ % FAMILIES.length]); });
    P.colors = fns.map((f) => {
      const h = hash(String(f && f.name)), b = base.get((f && f.module) || '');
      if (b === -1) return 'hsl(' + (h % 48) + ',' + (72 + (h >> 8) % 20) + '%,' + (56 + (h >> 16) % 12) + '%)';
      if (b === -2) return 'hsl(0,0%,' + (66 + h % 12) + '%)';
      return 'hsl(' + (b + h % 24 - 12) + ',' + (45 + (h >> 8) % 20) + '%,' + (60 + (h >> 16) % 12) + '%)';
    });
    P.legend = mods.slice(0, 8).map((m) => ({
      name: m || '(no module)',
      color: base.get(m) === -1 ? 'hsl(24,80%,60%)' : base.get(m) === -2 ? 'hsl(0,0%,70%)' : 'hsl(' + base.get(m) + ',55%,64%)',
    }));
  }
  // A diff colours by what happened under the node: red grew, blue shrank, pale when mixed.
  function diffColor(T, i) {
    const net = T.vals.net_bytes[i], churn = T.vals.added_bytes[i] + T.vals.removed_bytes[i];
    const r = churn > 0 ? Math.max(-1, Math.min(1, net / churn)) : net > 0 ? 1 : net < 0 ? -1 : 0;
    if (r === 0) return 'hsl(0,0%,78%)';
    return 'hsl(' + (r > 0 ? 2 : 214) + ',75%,' + (88 - 30 * Math.abs(r)).toFixed(0) + '%)';
  }

  // ---------- header ----------
  function card(k, v, s, bad) {
    return '<div class="card' + (bad ? ' bad' : '') + '"><div class="k">' + k + '</div><div class="v">' + v + '</div>' +
      (s ? '<div class="s">' + s + '</div>' : '') + '</div>';
  }
  function lostOf(p) {
    const s = p.leaks && p.leaks.summary;
    const get = (c) => (s && s[c]) || {};
    return {
      bytes: num(get('definitely_lost').bytes) + num(get('indirectly_lost').bytes) + num(get('possibly_lost').bytes),
      blocks: num(get('definitely_lost').blocks) + num(get('indirectly_lost').blocks) + num(get('possibly_lost').blocks),
    };
  }
  function timelineSpan(tl) {
    const t = tl && arr(tl.t_ms);
    return t && t.length > 1 ? num(t[t.length - 1]) - num(t[0]) : null;
  }
  // The one peak the page shows: the process's own count of its highest live bytes, exact, or
  // else the highest sample of its timeline (samples every 100 ms miss a short peak); null if
  // neither is known.
  function peakLive(p) {
    const st = p.stats && typeof p.stats === 'object' ? p.stats : null;
    const sampled = p.timeline ? arr(p.timeline.live_bytes).reduce((a, b) => Math.max(a, num(b)), 0) : null;
    if (st && typeof st.peak_live_bytes === 'number') return Math.max(st.peak_live_bytes, sampled || 0);
    return sampled;
  }
  function renderHeader(P) {
    const p = P.p, T = P.tree, st = p.stats && typeof p.stats === 'object' ? p.stats : null;
    $('report-title').textContent = DATA.title || 'heapdump';
    $('report-source').textContent = DATA.source ? 'From ' + DATA.source : '';
    let info = '<span class="proc">' + esc((p.name != null ? p.name : '?') + '[' + (p.pid != null ? p.pid : '?') + ']') + '</span>';
    if (p.command_line) info += '<span>command line <code>' + esc(p.command_line) + '</code></span>';
    if (p.snapshot_name) info += '<span>snapshot \u201c' + esc(p.snapshot_name) + '\u201d</span>';
    $('process-info').innerHTML = info;

    const span = timelineSpan(p.timeline);
    const dur = span == null ? '\u2013' : (span / 1000).toFixed(span < 10000 ? 2 : 1) + ' s';
    const cards = [];
    if (DIFF) {
      const v = T.vals;
      cards.push(card('Net change', hBytes(v.net_bytes[0], true), signedCount(v.net_blocks[0]) + ' blocks', v.net_bytes[0] > 0));
      cards.push(card('Growth', hBytes(v.delta_bytes[0]), 'sum of the stacks that grew'));
      cards.push(card('Added', hBytes(v.added_bytes[0])));
      cards.push(card('Removed', hBytes(v.removed_bytes[0])));
    } else {
      const live = st ? num(st.live_bytes) : T.vals.live_bytes[0], liveBlocks = st ? num(st.live_blocks) : T.vals.live_blocks[0];
      const peak = peakLive(p);
      cards.push(card('Live now', hBytes(live), plural(liveBlocks, 'block')));
      cards.push(card('Peak live', peak == null ? '\u2013' : hBytes(peak)));
      if (st) {
        cards.push(card('Allocated', hBytes(st.bytes_allocated), plural(num(st.blocks_allocated), 'block')));
        cards.push(card('Freed', hBytes(st.bytes_freed), plural(num(st.blocks_freed), 'block')));
      }
      // Where the process's resident memory was: the parts add up to it.
      const rs = p.resident && typeof p.resident === 'object' ? p.resident : null;
      if (rs) {
        cards.push(card('Resident', hBytes(rs.bytes), '<span id="resident-parts">allocator ' + hBytes(rs.allocator) +
          ' (live ' + hBytes(live) + ') \u00b7 heapdump ' + hBytes(rs.heapdump) + ' \u00b7 other anonymous ' +
          hBytes(rs.other_anonymous) + ' \u00b7 files ' + hBytes(rs.files) + '</span>'));
      }
    }
    cards.push(card('Duration', dur, p.timeline ? plural(arr(p.timeline.t_ms).length, 'sample') : 'no timeline'));
    // The snapshot's stacks: the page's less its "(smaller stacks)" stand-ins.
    const traces = p.stacks.filter((st) => !(st && st.smaller)).length;
    cards.push(card('Sites', count(p.sites.length), plural(traces, 'stack') + ', ' + plural(p.functions.length, 'function')));
    if (p.leaks) {
      const lost = lostOf(p);
      cards.push(card('Lost', lost.bytes ? '<a href="#leaks">' + hBytes(lost.bytes) + '</a>' : '0 B',
        plural(lost.blocks, 'block') + ' definitely, indirectly or possibly lost', lost.bytes > 0));
    }
    $('summary').innerHTML = cards.join('');

    // Recording statistics: anything heapdump could not record makes every number an undercount.
    let rec = '';
    if (st) {
      const items = [
        ['dropped_allocations', 'dropped allocations', 'allocations not recorded (table full): totals, sites and stacks undercount'],
        ['dropped_stack_traces', 'dropped stack traces', 'allocations recorded without their stack'],
        ['dropped_resources', 'dropped resources', 'thread or module records not stored: some frames may be unresolved'],
        ['truncated_traces', 'truncated traces', 'stacks cut at the frame limit: their root-most frames are missing'],
      ];
      rec = 'Recording: ' + items.map((it) => '<span class="stat' + (num(st[it[0]]) ? ' nonzero' : '') + '" data-stat="' + it[0] +
        '" title="' + it[2] + '">' + it[1] + ' ' + count(st[it[0]]) + '</span>').join(' \u00b7 ');
      const bad = items.filter((it) => num(st[it[0]]) > 0);
      if (bad.length) {
        rec += '<div class="warning" id="recording-warning">\u26a0 heapdump did not record everything in this process: ' +
          bad.map((it) => count(st[it[0]]) + ' ' + it[1] + ' (' + it[2] + ')').join('; ') + '.</div>';
      }
    } else {
      rec = '<span class="muted">No recording statistics in this ' + (DIFF ? 'diff' : 'snapshot') + '.</span>';
    }
    if (st && num(st.sample_bytes)) {
      rec = '<div id="sampled-note">Sampled: one block recorded per ' + count(st.sample_bytes) +
        ' bytes allocated on average, each counted as the blocks it stands for: every number here is an estimate.</div>' + rec;
    }
    if (st && st.recording) {
      rec = '<div id="armed-note">Armed: the blocks allocated since the process was armed are recorded' +
        (st.recording === 'disarmed' ? ' (it is disarmed now: none since)' : '') + '; ' +
        count(st.unattributed_bytes) + ' more live bytes, allocated before, are attributed to no site.</div>' + rec;
    }
    $('recording').innerHTML = rec;
  }

  // ---------- timeline ----------
  function cssVar(name) { return getComputedStyle(document.documentElement).getPropertyValue(name).trim(); }

  // Vertical lines at snapshot moments, drawn after the datasets with their names on top.
  const markerPlugin = {
    id: 'heapdumpMarkers',
    afterDatasetsDraw(ch, args, opts) {
      const xs = ch.scales.x, a = ch.chartArea, ctx = ch.ctx;
      ctx.save();
      ctx.strokeStyle = ctx.fillStyle = opts.color;
      ctx.font = '11px system-ui, sans-serif';
      ctx.setLineDash([4, 3]);
      arr(opts.markers).forEach((m, k) => {
        const x = xs.getPixelForValue(m.t);
        if (!(x >= a.left - 1 && x <= a.right + 1)) return;
        ctx.beginPath(); ctx.moveTo(x, a.top); ctx.lineTo(x, a.bottom); ctx.stroke();
        // Alternate label rows so that close markers stay legible.
        ctx.textAlign = x > a.right - 120 ? 'right' : 'left';
        ctx.fillText(m.name, x + (ctx.textAlign === 'left' ? 3 : -3), a.top + 10 + (k % 3) * 12);
      });
      ctx.restore();
    },
  };

  function renderTimeline(P) {
    const box = $('timeline'), list = $('timeline-markers');
    if (chart) { chart.destroy(); chart = null; }
    const tl = P.p.timeline;
    const t = tl && arr(tl.t_ms), live = tl && arr(tl.live_bytes);
    box.removeAttribute('data-peak-index'); box.removeAttribute('data-peak-bytes');
    list.innerHTML = '';
    if (!t || !t.length || !live.length) {
      box.className = 'timeline empty';
      box.innerHTML = '<p class="note">This ' + (DIFF ? 'diff' : 'snapshot') + ' carries no timeline.</p>';
      box.dataset.points = '0'; box.dataset.markers = '0';
      return;
    }
    box.className = 'timeline';
    const n = Math.min(t.length, live.length), alloc = arr(tl.bytes_allocated), markers = arr(tl.markers);
    const livePts = new Array(n), ratePts = [];
    let peak = 0;
    for (let i = 0; i < n; i++) {
      livePts[i] = { x: num(t[i]) / 1000, y: num(live[i]) };
      if (num(live[i]) > num(live[peak])) peak = i;
      // Allocation rate between successive samples of the cumulative total.
      if (i > 0 && i < alloc.length) {
        const dt = (num(t[i]) - num(t[i - 1])) / 1000;
        if (dt > 0) ratePts.push({ x: num(t[i]) / 1000, y: (num(alloc[i]) - num(alloc[i - 1])) / dt });
      }
    }
    // The peak is the header's (peakLive): above the highest sample when it fell between two,
    // drawn at that sample's time, "near" it.
    const peakBytes = Math.max(num(peakLive(P.p)), num(live[peak]));
    const between = peakBytes > num(live[peak]);
    box.dataset.points = String(n);
    box.dataset.peakIndex = String(peak);
    box.dataset.peakBytes = exact(peakBytes);
    box.dataset.markers = String(markers.length);
    // The peak mark: the moment the sites' "bytes at peak" are of.
    const mark = tl.peak_mark;
    if (mark) box.dataset.peakMarkMs = exact(mark.t_ms); else delete box.dataset.peakMarkMs;
    const drawn = mark ? markers.concat([{ t_ms: mark.t_ms, name: 'peak mark' }]) : markers;
    list.innerHTML = markers.map((m) => '<li data-t-ms="' + exact(m && m.t_ms) + '">' + esc(m && m.name != null ? m.name : '') +
      ' at ' + (num(m && m.t_ms) / 1000).toFixed(2) + ' s</li>').join('') +
      '<li class="peak">peak ' + hBytes(peakBytes) + (between ? ' near ' : ' at ') + (num(t[peak]) / 1000).toFixed(2) + ' s</li>' +
      (mark ? '<li class="peak-mark">what was live at the peak: ' + hBytes(num(mark.bytes)) + ' at ' + (num(mark.t_ms) / 1000).toFixed(2) + ' s (the "Bytes at peak" metric)</li>' : '');

    if (typeof Chart === 'undefined') { box.innerHTML = '<p class="note">Chart library missing.</p>'; return; }
    box.innerHTML = '<canvas></canvas>';
    const fg = cssVar('--muted'), grid = cssVar('--grid'), cLive = cssVar('--live'), cRate = cssVar('--rate');
    chart = new Chart(box.firstChild, {
      type: 'line',
      data: {
        datasets: [
          { label: 'Live bytes', data: livePts, yAxisID: 'y', borderColor: cLive, backgroundColor: cLive + '33', fill: 'origin', borderWidth: 1.5, pointRadius: 0, order: 2 },
          // Rate samples are noisy: a thin, translucent line behind the live bytes.
          { label: 'Allocation rate', data: ratePts, yAxisID: 'y1', borderColor: cRate + '99', backgroundColor: cRate, borderWidth: 1, pointRadius: 0, order: 3 },
          { label: 'Peak', type: 'scatter', data: [{ x: livePts[peak].x, y: peakBytes }], yAxisID: 'y', borderColor: cLive, backgroundColor: cLive, pointRadius: 4, order: 1 },
        ],
      },
      options: {
        animation: false, parsing: false, normalized: true, responsive: true, maintainAspectRatio: false,
        interaction: { mode: 'nearest', axis: 'x', intersect: false },
        color: fg, borderColor: grid,
        scales: {
          x: { type: 'linear', min: livePts[0].x, max: livePts[n - 1].x, title: { display: true, text: 'time (s)', color: fg }, ticks: { color: fg }, grid: { color: grid } },
          y: { beginAtZero: true, title: { display: true, text: 'live', color: fg }, ticks: { color: fg, callback: (v) => bytes(v) }, grid: { color: grid } },
          y1: { beginAtZero: true, position: 'right', title: { display: true, text: 'allocated per second', color: fg }, ticks: { color: fg, callback: (v) => bytes(v) + '/s' }, grid: { drawOnChartArea: false } },
        },
        plugins: {
          decimation: { enabled: true, algorithm: 'min-max' },
          legend: { labels: { color: fg, boxWidth: 12, sort: (a, b) => a.datasetIndex - b.datasetIndex } },
          tooltip: {
            callbacks: {
              title: (items) => (items.length ? 't = ' + items[0].parsed.x.toFixed(3) + ' s' : ''),
              label: (c) => c.dataset.label + ': ' + bytes(c.parsed.y) + (c.datasetIndex === 1 ? '/s' : '') + ' (' + count(Math.round(c.parsed.y)) + ')',
            },
          },
          heapdumpMarkers: { color: cssVar('--marker'), markers: drawn.map((m) => ({ t: num(m && m.t_ms) / 1000, name: String(m && m.name != null ? m.name : '') })) },
        },
      },
      plugins: [markerPlugin],
    });
  }

  // ---------- flame graph ----------
  let CHAR_W = 7.2;
  // Labels are cut to the box in JS (tests read them): measure the node font's character width once.
  function measureChar() {
    const probe = document.createElement('div');
    probe.className = 'flame-node';
    $('flame').appendChild(probe);
    const c = document.createElement('canvas').getContext('2d');
    c.font = getComputedStyle(probe).font || '12px monospace';
    probe.remove();
    const w = c.measureText('abcdefghijklmnopqrstuvwxyz<>:_()').width / 32;
    if (w > 3 && w < 20) CHAR_W = w;
  }

  // The subtree of z holding the nodes at least `thr` wide: what d3 lays out. A node's
  // dropped children stay part of its own ("self") value so the widths still add up.
  function pruned(T, v, z, thr) {
    const end = T.end;
    const walk = (i) => {
      const node = { i, s: v[i], c: null };
      for (let c = i + 1; c < end[i]; c = end[c]) {
        if (v[c] > 0 && v[c] >= thr) {
          (node.c || (node.c = [])).push(walk(c));
          node.s -= v[c];
        }
      }
      return node;
    };
    return walk(z);
  }

  const flameWidth = () => Math.max(200, $('flame').clientWidth || 1200);
  function renderFlame() {
    const P = state.P, T = P.tree, m = METRIC[state.metric], v = T.vals[m.key], box = $('flame');
    const W = flameWidth();
    let z = state.zoom < T.count ? state.zoom : 0;
    const matches = state.search ? P.matchFlags : null;
    const parts = [];
    const node = (i, x, w, y, cls) => {
      const name = nodeName(P, i);
      const room = Math.floor((w - 6) / CHAR_W);
      const text = room >= name.length ? name : room >= 3 ? name.slice(0, room - 1) + '\u2026' : '';
      const color = i === 0 ? 'var(--line)' : DIFF ? diffColor(T, i) : P.colors[T.fn[i]] || '#bbb';
      const hit = matches && i > 0 && matches[T.fn[i]] ? ' match' : '';
      parts.push('<div class="flame-node' + (i ? cls : cls + ' root') + hit + (text ? ' t' : '') + '" data-i="' + i + '" data-name="' + esc(name) +
        '" data-value="' + exact(v[i]) + '" data-depth="' + T.depth[i] + '" style="left:' + x.toFixed(1) + 'px;width:' +
        (w >= 3 ? w - 1 : w).toFixed(1) + 'px;top:' + y + 'px;background:' + color + '">' + esc(text) + '</div>');
    };
    // Ancestors of the zoomed node: full width above it, dimmed; clicking one zooms out to it.
    const anc = [];
    for (let a = T.parent[z]; a >= 0; a = T.parent[a]) anc.unshift(a);
    anc.forEach((a) => node(a, 0, W, T.depth[a] * ROW, ' ancestor'));
    const zy = T.depth[z];
    let rows = zy + 1, drawn = anc.length;
    if (v[z] > 0 && typeof d3 !== 'undefined') {
      const h = d3.hierarchy(pruned(T, v, z, v[z] * MIN_PX / W), (d) => d.c)
        .sum((d) => d.s)
        .sort((a, b) => b.value - a.value || a.data.i - b.data.i);
      d3.partition().size([W, h.height + 1])(h);
      h.each((d) => {
        node(d.data.i, d.x0, d.x1 - d.x0, (zy + d.depth) * ROW, '');
        drawn++;
      });
      rows = zy + h.height + 1;
    } else {
      node(z, 0, W, zy * ROW, '');
      drawn++;
      parts.push('<p class="note flame-empty" style="top:' + (rows * ROW + 4) + 'px">' +
        (typeof d3 === 'undefined' ? 'Layout library missing.' : 'Nothing to show for ' + esc(m.label.toLowerCase()) + '.') + '</p>');
      rows += 2;
    }
    box.style.height = rows * ROW + 'px';
    box.innerHTML = parts.join('');
    box.classList.toggle('searching', !!matches);
    box.dataset.metric = m.key;
    box.dataset.rootValue = exact(v[0]);
    box.dataset.zoom = z ? nodeName(P, z) : '';
    box.dataset.zoomDepth = String(zy);
    box.dataset.nodes = String(drawn);
    box.dataset.width = String(W);
    $('flame-reset').disabled = z === 0;
    $('flame-total').textContent = m.label.toLowerCase() + ': ' + (m.isBytes ? bytes(v[0]) : count(v[0])) +
      (m.isBytes ? ' (' + count(v[0]) + ' bytes)' : '');
  }

  // Nodes at one depth in the order drawn (larger first), for zoom(name)'s breadth-first search.
  function childrenByValue(T, v, i) {
    const kids = [];
    for (let c = i + 1; c < T.end[i]; c = T.end[c]) if (v[c] > 0) kids.push(c);
    return kids.sort((a, b) => v[b] - v[a] || a - b);
  }
  function findNode(name) {
    const P = state.P, T = P.tree, v = T.vals[state.metric];
    if (name === 'all') return 0;
    if (!P.p.functions.some((f) => f && String(f.name) === name)) return -1;
    let level = [0];
    while (level.length) {
      const next = [];
      for (const i of level) {
        for (const c of childrenByValue(T, v, i)) {
          if (nodeName(P, c) === name) return c;
          next.push(c);
        }
      }
      level = next;
    }
    return -1;
  }
  function zoomTo(i) {
    state.zoom = i;
    renderFlame();
  }

  // Search: which functions match, and how much of the root they hold (a match inside a
  // match is counted as a match but its value is already in its ancestor's).
  function computeSearch() {
    const P = state.P, T = P.tree, v = T.vals[state.metric], q = state.search.toLowerCase();
    const status = $('flame-search-status');
    if (!q) {
      P.matchFlags = null;
      status.textContent = '';
      ['functions', 'nodes', 'value', 'percent'].forEach((k) => status.removeAttribute('data-' + k));
      return null;
    }
    if (!P.lower) P.lower = P.p.functions.map((f, k) => fnName(P, k).toLowerCase());
    const flags = new Uint8Array(P.lower.length);
    P.lower.forEach((s, k) => { if (s.indexOf(q) >= 0) flags[k] = 1; });
    P.matchFlags = flags;
    const seen = new Set();
    let nodes = 0, total = 0, covered = 0;
    for (let i = 1; i < T.count; i++) {
      if (!flags[T.fn[i]] || !(v[i] > 0)) continue;
      nodes++;
      seen.add(T.fn[i]);
      if (i >= covered) { total += v[i]; covered = T.end[i]; }
    }
    const root = v[0], m = METRIC[state.metric], share = root > 0 ? 100 * total / root : 0;
    status.dataset.functions = String(seen.size);
    status.dataset.nodes = String(nodes);
    status.dataset.value = exact(total);
    status.dataset.percent = share.toFixed(2);
    status.textContent = seen.size ? plural(seen.size, 'function') + ' in ' + plural(nodes, 'frame') + ' match: ' +
      (m.isBytes ? bytes(total) : count(total)) + ' of ' + (m.isBytes ? bytes(root) : count(root)) + ' (' + pct(total, root) + ')' : 'no match';
    return { functions: seen.size, nodes, value: total, total: root, percent: share };
  }

  const tip = $('flame-tooltip');
  function showTip(i, ev) {
    const P = state.P, T = P.tree, V = T.vals, f = i ? fnOf(P, T.fn[i]) : null;
    const cur = state.metric;
    const line = (label, keys) => {
      const isCur = keys.indexOf(cur) >= 0;
      return '<tr' + (isCur ? ' class="cur"' : '') + '><td>' + label + '</td>' + keys.map((k) => {
        const bytesKey = /bytes/.test(k), signed = /^net/.test(k);
        return '<td class="num">' + (bytesKey ? bytes(V[k][i], signed) : (signed ? signedCount(V[k][i]) : count(V[k][i])) + ' blocks') +
          '</td><td class="num muted">' + (signed ? '' : pct(V[k][i], V[k][0])) + '</td>';
      }).join('') + '</tr>';
    };
    const rows = DIFF
      ? line('Net', ['net_bytes', 'net_blocks']) + line('Growth', ['delta_bytes', 'delta_blocks']) +
        line('Added', ['added_bytes']) + line('Removed', ['removed_bytes'])
      : line('Live', ['live_bytes', 'live_blocks']) + line('Allocated', ['alloc_bytes', 'alloc_blocks']) +
        line('Temporary', ['temp_blocks']);
    let self = V[cur][i];
    for (let c = i + 1; c < T.end[i]; c = T.end[c]) self -= V[cur][c];
    const unit = METRIC[cur].isBytes ? bytes(self) : count(self) + ' blocks';
    tip.innerHTML = '<div class="fn">' + esc(nodeName(P, i)) + '</div>' +
      (i ? '<div class="muted">' + esc(nodeLoc(P, i) || 'no source location') + (f && f.module ? ' \u00b7 ' + esc(f.module) : '') + '</div>' : '') +
      '<table>' + rows + '</table><div class="muted">self (in no callee): ' + unit + ' \u00b7 click to ' + (i ? 'zoom' : 'reset zoom') + '</div>';
    tip.hidden = false;
    moveTip(ev);
  }
  function moveTip(ev) {
    const r = tip.getBoundingClientRect();
    let x = ev.clientX + 14, y = ev.clientY + 16;
    if (x + r.width > window.innerWidth - 8) x = Math.max(4, ev.clientX - r.width - 14);
    if (y + r.height > window.innerHeight - 8) y = Math.max(4, ev.clientY - r.height - 12);
    tip.style.left = x + 'px';
    tip.style.top = y + 'px';
  }

  // ---------- stacks (sites and leaks) ----------
  function stackValues(st) {
    if (!st) return '';
    if (DIFF) {
      return 'net ' + bytes(st.delta_bytes, true) + ' (' + signedCount(num(st.delta_blocks)) + ' blocks), added ' +
        bytes(st.added_bytes) + ', removed ' + bytes(st.removed_bytes);
    }
    return bytes(st.live_bytes) + ' live in ' + plural(num(st.live_blocks), 'block') + ', ' + bytes(st.alloc_bytes) +
      ' allocated in ' + plural(num(st.alloc_blocks), 'block');
  }
  // A site's stacks, heaviest first by the metric the flame graph shows (ties: recording order).
  function byMetric(P, idxs) {
    const src = METRIC[state.metric].src, stacks = P.p.stacks;
    const value = (si) => num(stacks[si] && stacks[si][src]);
    return idxs.map((si, k) => [si, k]).sort((a, b) => value(b[0]) - value(a[0]) || a[1] - b[1]).map((e) => e[0]);
  }
  function stacksHtml(P, given, all, withValues) {
    const idxs = withValues ? byMetric(P, given) : given;
    const stacks = P.p.stacks, shown = all ? idxs : idxs.slice(0, STACKS_SHOWN);
    let h = '';
    shown.forEach((si, k) => {
      const st = stacks[si];
      const fr = st && Array.isArray(st.frames) ? st.frames.slice().reverse() : [];
      const lines = st && Array.isArray(st.lines) ? st.lines.slice().reverse() : [];
      h += '<div class="stack" data-stack="' + exact(si) + '"><div class="stack-head">' +
        (idxs.length > 1 ? 'Stack ' + (k + 1) + ' of ' + idxs.length + ': ' : '') + (withValues ? esc(stackValues(st)) : '') +
        (st ? '' : 'stack ' + esc(si) + ' missing') + '</div><ol class="frames">' +
        fr.map((x, k) => {
          const f = fnOf(P, x), where = locAt(f, lines[k]);
          return '<li><span class="fn">' + esc(fnName(P, x)) + '</span>' + (where ? '<span class="loc">' + esc(where) + '</span>' : '') +
            (f && f.module ? '<span class="mod">' + esc(f.module) + '</span>' : '') + '</li>';
        }).join('') + (fr.length ? '' : '<li class="muted">(no frames)</li>') + '</ol></div>';
    });
    if (shown.length < idxs.length) h += '<button type="button" class="more-stacks">Show all ' + count(idxs.length) + ' stacks</button>';
    return h;
  }
  // Toggle the row after `tr` listing stacks; `make(all)` returns its HTML.
  function toggleStacks(tr, set, key, cls, make, all) {
    const next = tr.nextElementSibling;
    const open = next && next.classList.contains('stacks-row');
    if (open) next.remove();
    if (open && !all) { set.delete(key); tr.classList.remove('expanded'); return; }
    set.add(key);
    tr.classList.add('expanded');
    tr.insertAdjacentHTML('afterend', '<tr class="stacks-row ' + cls + '" data-index="' + esc(key) + '"><td colspan="' +
      tr.cells.length + '">' + make(all) + '</td></tr>');
  }

  // ---------- sites table ----------
  const cell = (fmt, v) => {
    const text = fmt === 'bytes' ? bytes(v) : fmt === 'sbytes' ? bytes(v, true) : fmt === 'scount' ? signedCount(num(v)) : count(v);
    return '<td class="num" title="' + count(v) + '">' + text + '</td>';
  };
  const dataAttr = (k) => 'data-' + k.replace(/_/g, '-');

  // A site's stacks too small to draw one by one: summed under "(smaller stacks)" of their
  // callers in the flame graph, and said here so that the site's list adds up.
  function smallerNote(s) {
    const sm = s && s.smaller;
    if (!sm || !num(sm.stacks)) return '';
    return '<p class="note smaller-stacks">And ' + plural(num(sm.stacks), 'smaller stack') + ': ' +
      esc(stackValues(sm)) + ' (in the flame graph under \u201c(smaller stacks)\u201d).</p>';
  }

  function sitesOrder() {
    const sites = state.P.p.sites, idx = sites.map((_, i) => i), key = state.sort.key;
    if (!key) return idx;
    const dir = state.sort.desc ? -1 : 1;
    if (key === 'name') {
      const names = sites.map((s) => String(s && s.name));
      return idx.sort((a, b) => (names[a] < names[b] ? -dir : names[a] > names[b] ? dir : a - b));
    }
    return idx.sort((a, b) => dir * (num(sites[a] && sites[a][key]) - num(sites[b] && sites[b][key])) || a - b);
  }

  function renderSitesHead() {
    $('sites-table').tHead.innerHTML = '<tr>' + SITE_COLS.map((c) => {
      const sorted = state.sort.key === c.key;
      return '<th data-key="' + c.key + '"' + (c.key === 'name' ? '' : ' class="num"') + ' aria-sort="' +
        (sorted ? (state.sort.desc ? 'descending' : 'ascending') : 'none') + '" tabindex="0" title="Sort">' + c.label + '</th>';
    }).join('') + '</tr>';
  }

  function renderSites() {
    const P = state.P, sites = P.p.sites, order = sitesOrder();
    const shown = state.sitesAll ? order : order.slice(0, SITES_PAGE);
    renderSitesHead();
    const rows = shown.map((i) => {
      const s = sites[i] || {};
      let r = '<tr class="site-row' + (state.expandedSites.has(i) ? ' expanded' : '') + '" data-index="' + i + '" data-name="' +
        esc(s.name != null ? s.name : '?') + '"';
      SITE_COLS.forEach((c) => { if (c.key !== 'name') r += ' ' + dataAttr(c.key) + '="' + exact(s[c.key]) + '"'; });
      r += '><td class="name">' + esc(s.name != null ? s.name : '?') + (loc(s) ? '<span class="loc">' + esc(loc(s)) + '</span>' : '') + '</td>';
      SITE_COLS.forEach((c) => { if (c.key !== 'name') r += cell(c.fmt, s[c.key]); });
      r += '</tr>';
      if (state.expandedSites.has(i)) {
        r += '<tr class="stacks-row site-stacks" data-index="' + i + '"><td colspan="' + SITE_COLS.length + '">' +
          stacksHtml(P, arr(s.stacks), false, true) + smallerNote(s) + '</td></tr>';
      }
      return r;
    });
    if (!sites.length) rows.push('<tr><td colspan="' + SITE_COLS.length + '" class="note">No allocation sites.</td></tr>');
    $('sites-table').tBodies[0].innerHTML = rows.join('');
    $('sites-count').textContent = sites.length ? '(' + count(sites.length) + ')' : '';
    const wrappers = arr(P.p.alloc_fns), note = $('sites-alloc-fns');
    note.hidden = !wrappers.length;
    note.textContent = wrappers.length ? 'Allocation wrappers taken for the allocator (the sites are their callers): ' + wrappers.join(', ') + '.' : '';
    const more = $('sites-more');
    more.hidden = shown.length >= order.length;
    more.textContent = 'Show all ' + count(order.length) + ' sites';
    $('sites-table').dataset.rows = String(shown.length);
  }

  function sortSites(key, desc) {
    if (key == null || key === 'order') { state.sort = { key: null, desc: true }; renderSites(); return true; }
    if (!SITE_COLS.some((c) => c.key === key)) return false;
    // No direction given (a header click): a new column starts descending, the same one flips.
    if (typeof desc !== 'boolean') desc = state.sort.key === key ? !state.sort.desc : key !== 'name';
    state.sort = { key, desc };
    renderSites();
    return true;
  }

  // ---------- leaks ----------
  function renderLeaks() {
    const P = state.P, L = P.p.leaks, sec = $('leaks');
    const show = !!(L && typeof L === 'object');
    sec.hidden = !show;
    $('toc-leaks').hidden = !show;
    if (!show) return;
    const summ = L.summary || {}, groups = arr(L.groups);
    $('leak-summary').innerHTML = LEAK_CATS.map((c) => {
      const s = summ[c] || {}, lost = c !== 'still_reachable' && num(s.bytes) > 0;
      return '<li class="leak-cat' + (lost ? ' lost' : '') + '" data-category="' + c + '" data-bytes="' + exact(s.bytes) +
        '" data-blocks="' + exact(s.blocks) + '">' + catWords(c) + ': ' + hBytes(s.bytes) + ' in ' + plural(num(s.blocks), 'block') + '</li>';
    }).join('') + (summ.unconfirmed && num(summ.unconfirmed.blocks) > 0
      // heapdump leaks: lost in its last scan only, so perhaps a pointer in flight; not reported.
      ? '<li class="leak-cat unconfirmed" data-category="unconfirmed" data-bytes="' + exact(summ.unconfirmed.bytes) + '" data-blocks="' +
        exact(summ.unconfirmed.blocks) + '">not confirmed (lost in the last scan only, not reported): ' + hBytes(summ.unconfirmed.bytes) +
        ' in ' + plural(num(summ.unconfirmed.blocks), 'block') + '</li>'
      : '');
    const anyLost = LEAK_CATS.slice(0, 3).some((c) => num((summ[c] || {}).bytes) > 0 || num((summ[c] || {}).blocks) > 0) ||
      groups.some((g) => g && g.category !== 'still_reachable');
    $('leaks-none').hidden = anyLost;
    // What this leak check could not see (a sampled or armed process): the report's note.
    const scope = typeof L.scope_note === 'string' ? L.scope_note : '';
    $('leaks-scope-note').hidden = !scope;
    $('leaks-scope-note').textContent = scope ? 'Note: ' + scope + '.' : '';
    const reach = $('leaks-show-reachable').checked;
    const rows = [];
    groups.forEach((g, i) => {
      if (!g || (g.category === 'still_reachable' && !reach)) return;
      const open = state.expandedLeaks.has(i);
      rows.push('<tr class="leak-row' + (open ? ' expanded' : '') + '" data-index="' + i + '" data-category="' + esc(g.category) +
        '" data-site="' + esc(g.site != null ? g.site : '?') + '" data-bytes="' + exact(g.bytes) + '" data-blocks="' + exact(g.blocks) +
        '"><td class="cat-' + esc(g.category) + '">' + esc(catWords(g.category)) + '</td><td class="name">' + esc(g.site != null ? g.site : '?') + leafLoc(g.stack) +
        '</td>' + cell('bytes', g.bytes) + cell('count', g.blocks) + '</tr>');
      if (open) rows.push('<tr class="stacks-row leak-stacks" data-index="' + i + '"><td colspan="4">' + leakStack(g) + '</td></tr>');
    });
    if (!rows.length) {
      rows.push('<tr><td colspan="4" class="note">' + (groups.length ? 'Only still reachable groups: tick the box above to list them.' : 'No groups to list.') + '</td></tr>');
    }
    $('leaks-table').tBodies[0].innerHTML = rows.join('');
  }
  // A leak group names its site; where it is comes from the leaf frame of its stack.
  function leafLoc(si) {
    const st = state.P.p.stacks[si], fr = st && Array.isArray(st.frames) ? st.frames : [];
    const lines = st && Array.isArray(st.lines) ? st.lines : [];
    const l = fr.length ? locAt(fnOf(state.P, fr[fr.length - 1]), lines[fr.length - 1]) : '';
    return l ? '<span class="loc">' + esc(l) + '</span>' : '';
  }
  const leakStack = (g) => (typeof g.stack === 'number' ? stacksHtml(state.P, [g.stack], true, false) : '<p class="note">No stack recorded.</p>');

  function renderLegend() {
    const lg = state.P.legend, sw = (c) => '<span class="sw" style="background:' + c + '"></span>';
    $('flame-legend').innerHTML = DIFF
      ? 'Width: ' + esc(METRIC[state.metric].label.toLowerCase()) + '. Colour: ' + sw('hsl(2,75%,60%)') + 'grew' + sw('hsl(214,75%,60%)') +
        'shrank' + sw('hsl(0,0%,78%)') + 'unchanged (added = removed)'
      : lg.length > 1 ? 'Modules:' + lg.map((l) => sw(l.color) + esc(l.name)).join('') : '';
  }

  // ---------- process switching and the API ----------
  function selectProcess(i) {
    i = Number(i);
    if (!(i >= 0 && i < PROCS.length && i % 1 === 0)) return false;
    state.proc = i;
    state.P = prepare(i);
    state.zoom = 0;
    state.sitesAll = false;
    state.expandedSites.clear();
    state.expandedLeaks.clear();
    $('process-select').value = String(i);
    renderHeader(state.P);
    mark('header');
    renderTimeline(state.P);
    mark('timeline');
    renderLegend();
    computeSearch();
    renderFlame();
    mark('flame');
    renderSites();
    mark('sites');
    renderLeaks();
    return true;
  }
  function setMetric(name) {
    if (!METRIC[name]) return false;
    state.metric = name;
    $('flame-metric').value = name;
    if (state.P.tree.vals[name][state.zoom] <= 0) state.zoom = 0;
    computeSearch();
    renderFlame();
    renderLegend();
    return true;
  }
  function zoom(name) {
    const i = findNode(String(name));
    if (i < 0) return false;
    zoomTo(i);
    return true;
  }
  function resetZoom() { zoomTo(0); }
  function search(text) {
    state.search = text == null ? '' : String(text);
    if ($('flame-search').value !== state.search) $('flame-search').value = state.search;
    const r = computeSearch();
    renderFlame();
    return r;
  }

  // ---------- wiring ----------
  const sel = $('process-select');
  sel.innerHTML = PROCS.map((p, i) => '<option value="' + i + '">' + esc((p && p.name != null ? p.name : '?') + '[' + (p && p.pid != null ? p.pid : '?') + ']') + '</option>').join('');
  $('process-picker').hidden = PROCS.length < 2;
  sel.addEventListener('change', () => selectProcess(sel.value));
  $('flame-metric').innerHTML = METRICS.map((m) => '<option value="' + m.key + '">' + m.label + '</option>').join('');
  $('flame-metric').value = state.metric;
  $('flame-metric').addEventListener('change', (e) => setMetric(e.target.value));
  $('flame-reset').addEventListener('click', resetZoom);
  // Typing re-lays out the whole graph: wait for a pause in the keystrokes.
  let searchTimer = 0;
  $('flame-search').addEventListener('input', (e) => {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(() => search(e.target.value), 120);
  });
  $('flame-search').addEventListener('keydown', (e) => { if (e.key === 'Escape') { clearTimeout(searchTimer); search(''); } });

  const flame = $('flame');
  const nodeIndex = (e) => { const n = e.target.closest && e.target.closest('.flame-node'); return n ? Number(n.dataset.i) : -1; };
  flame.addEventListener('click', (e) => {
    const i = nodeIndex(e);
    if (i < 0) return;
    if (i === 0) resetZoom(); else zoomTo(i);
  });
  flame.addEventListener('mouseover', (e) => { const i = nodeIndex(e); if (i >= 0) showTip(i, e); });
  flame.addEventListener('mousemove', (e) => { if (!tip.hidden) moveTip(e); });
  flame.addEventListener('mouseleave', () => { tip.hidden = true; });

  $('sites-table').tHead.addEventListener('click', (e) => {
    const th = e.target.closest('th[data-key]');
    if (th) sortSites(th.dataset.key);
  });
  $('sites-table').tHead.addEventListener('keydown', (e) => {
    const th = e.target.closest('th[data-key]');
    if (!th || (e.key !== 'Enter' && e.key !== ' ')) return;
    e.preventDefault();
    sortSites(th.dataset.key);
    $('sites-table').tHead.querySelector('th[data-key="' + th.dataset.key + '"]').focus(); // the head was redrawn
  });
  $('sites-table').tBodies[0].addEventListener('click', (e) => {
    const more = e.target.closest('.more-stacks');
    const tr = more ? e.target.closest('tr.stacks-row').previousElementSibling : e.target.closest('tr.site-row');
    if (!tr) return;
    const i = Number(tr.dataset.index), s = state.P.p.sites[i] || {};
    toggleStacks(tr, state.expandedSites, i, 'site-stacks', (all) => stacksHtml(state.P, arr(s.stacks), all, true) + smallerNote(s), !!more);
  });
  $('sites-more').addEventListener('click', () => { state.sitesAll = true; renderSites(); });
  $('leaks-table').tBodies[0].addEventListener('click', (e) => {
    const tr = e.target.closest('tr.leak-row');
    if (!tr) return;
    const i = Number(tr.dataset.index), g = arr(state.P.p.leaks && state.P.p.leaks.groups)[i];
    if (g) toggleStacks(tr, state.expandedLeaks, i, 'leak-stacks', () => leakStack(g), false);
  });
  $('leaks-show-reachable').addEventListener('change', renderLeaks);

  // The icicle is laid out in pixels: lay it out again when its width changes.
  let resizeTimer = 0;
  if (typeof ResizeObserver !== 'undefined') {
    new ResizeObserver(() => {
      clearTimeout(resizeTimer);
      resizeTimer = setTimeout(() => {
        if (state.P && flame.clientWidth > 0 && String(flameWidth()) !== flame.dataset.width) renderFlame();
      }, 100);
    }).observe(flame);
  }

  const api = window.heapdumpReport = {
    ready: false, firstViewMs: null, firstPaintMs: null, timings, kind: DIFF ? 'diff' : 'snapshot', processes: PROCS.length,
    metrics: METRICS.map((m) => m.key),
    selectProcess, setMetric, zoom, resetZoom, search, sortSites,
    state: () => ({
      process: state.proc, metric: state.metric, zoom: state.zoom ? nodeName(state.P, state.zoom) : null,
      search: state.search, sort: { key: state.sort.key, desc: state.sort.desc },
    }),
  };

  if (PROCS.length) {
    measureChar();
    selectProcess(0);
  } else {
    $('report-title').textContent = DATA.title || 'heapdump';
    document.querySelector('main').innerHTML = '<p class="note">This report holds no process.</p>';
  }
  void document.body.offsetHeight; // count style and layout of the first view too
  mark('layout');
  // From the start of navigation (performance.now()'s origin), so the first view counts reading
  // and parsing the page, data included, as a person opening it waits for them.
  api.firstViewMs = Math.round(performance.now() * 10) / 10;
  api.ready = true;
  document.body.dataset.firstViewMs = String(api.firstViewMs);
  document.body.dataset.ready = '1';
  // And when the first frame is on screen (style, layout and paint done).
  requestAnimationFrame(() => setTimeout(() => {
    api.firstPaintMs = Math.round(performance.now() * 10) / 10;
    document.body.dataset.firstPaintMs = String(api.firstPaintMs);
  }, 0));
}());
