// isoserve operator console: polls /console/snapshot at most twice a second
// and draws it. Self-contained: no library, no external fetch (the page's
// Content-Security-Policy allows this origin only).
'use strict';

(function () {
  const POLL_MS = 500;
  const STATES = {
    '.': 'free', p: 'poisoned', c: 'cached', o: 'private', l: 'leased', r: 'release pending',
  };
  // Distinct hues for tenants and groups (by label index).
  const PALETTE = ['#4e9af1', '#f1c84e', '#c35ef1', '#4ef1b0', '#f1784e', '#9af14e',
    '#f14e9a', '#4ee0f1', '#b0a0ff', '#ffb0a0', '#a0ffb0', '#e0e0e0'];
  const colour = (label) => (label < 0 ? '' : PALETTE[label % PALETTE.length]);

  const $ = (id) => document.getElementById(id);
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const fmt = (x, d) => (x === null || x === undefined ? '–' : Number(x).toFixed(d || 0));

  let failures = 0;
  const nodeViews = new Map();
  const tiles = new Map();

  function legend() {
    const box = $('legend');
    for (const [code, name] of Object.entries(STATES)) {
      const s = el('span');
      const c = el('span', 'cell s-' + (code === '.' ? 'f' : code));
      if ('clor'.includes(code)) c.style.backgroundColor = '#8391a0';
      s.append(c, document.createTextNode(name));
      box.append(s);
    }
  }

  function status(text, cls) {
    const s = $('status');
    s.textContent = text;
    s.className = 'status ' + (cls || '');
  }

  function sparkline(values) {
    const ns = 'http://www.w3.org/2000/svg';
    const svg = document.createElementNS(ns, 'svg');
    svg.setAttribute('viewBox', '0 0 100 22');
    svg.setAttribute('preserveAspectRatio', 'none');
    const line = document.createElementNS(ns, 'polyline');
    const lo = Math.min(...values, 0);
    const hi = Math.max(...values, lo + 1);
    const n = Math.max(values.length - 1, 1);
    line.setAttribute('points', values.map((v, i) =>
      `${(i / n * 100).toFixed(1)},${(20 - (v - lo) / (hi - lo) * 18).toFixed(1)}`).join(' '));
    svg.append(line);
    return svg;
  }

  const safetyBoxes = new Map();
  function safetyBox(node) {
    let box = safetyBoxes.get(node);
    if (!box) {
      const group = el('div', 'safety-node');
      group.dataset.node = node;
      box = el('div', 'tiles');
      group.append(el('h3', '', node), box);
      $('safety').append(group);
      safetyBoxes.set(node, box);
    }
    return box;
  }

  function drawSafety(rows) {
    for (const r of rows) {
      const box = safetyBox(r.node);
      const key = r.node + '/' + r.name;
      let t = tiles.get(key);
      if (!t) {
        t = { root: el('div', 'tile'), name: el('div', 'name', r.name),
          value: el('div', 'value'), spark: null, last: r.value };
        t.root.dataset.counter = r.name;
        t.root.dataset.node = r.node;
        t.root.title = `${r.name} on ${r.node}`;
        t.root.append(t.name, t.value);
        box.append(t.root);
        tiles.set(key, t);
      }
      const moved = r.moved || r.value !== t.last;
      t.last = r.value;
      t.value.textContent = r.value;
      t.root.classList.toggle('moved', moved);
      t.root.classList.toggle('nonzero', r.value > 0);
      t.root.dataset.value = String(r.value);
      const s = sparkline(r.history.length ? r.history : [r.value]);
      if (t.spark) t.spark.replaceWith(s); else t.root.append(s);
      t.spark = s;
    }
  }

  function drawTenants(snap) {
    const body = $('tenants').tBodies[0];
    body.replaceChildren();
    for (const t of snap.tenants) {
      const tr = el('tr');
      tr.dataset.tenant = t.name;
      const name = el('td');
      const sw = el('span', 'swatch');
      sw.style.backgroundColor = colour(t.label);
      sw.dataset.label = String(t.label);
      name.append(sw, document.createTextNode(t.name));
      const share = el('td');
      const bar = el('span', 'bar');
      const fill = el('i');
      fill.style.width = (Math.min(t.share, 1) * 100).toFixed(0) + '%';
      const mark = el('b');
      mark.style.left = (Math.min(t.weight_share, 1) * 100).toFixed(0) + '%';
      bar.append(fill, mark);
      share.append(bar, document.createTextNode(
        ` ${fmt(t.share * 100)}% / ${fmt(t.weight_share * 100)}%`));
      const cells = [name, el('td', '', t.weight), el('td', 'in-flight', t.in_flight),
        el('td', 'running', fmt(t.running)), el('td', 'queued', fmt(t.queued)),
        el('td', '', fmt(t.preempted)), el('td', 'tps', fmt(t.tokens_per_s, 1)), share,
        el('td', '', `${fmt(t.cache_hit_rate * 100)}% (${t.cached_tokens}/${t.prompt_tokens})`),
        el('td', 'pages', t.pages), el('td', '', t.finished), el('td', 'refused', t.refused)];
      tr.append(...cells);
      body.append(tr);
    }
  }

  function nodeView(n) {
    let v = nodeViews.get(n.name);
    if (!v) {
      v = { root: el('div', 'node'), title: el('h3'), counts: el('div', 'counts'),
        grid: el('div', 'grid'), transfers: el('div', 'transfers'), cells: [], keys: [] };
      v.root.dataset.node = n.name;
      v.root.append(v.title, v.counts, v.grid, v.transfers);
      $('nodes').append(v.root);
      nodeViews.set(n.name, v);
    }
    return v;
  }

  function drawNode(n, labels) {
    const v = nodeView(n);
    v.root.dataset.role = n.role;
    v.title.textContent = `${n.name} · ${n.role} · ${n.pages_total} pages of ${n.page_size_tokens} tokens` +
      (n.pages_per_cell > 1 ? ` · ${n.pages_per_cell} pages a cell` : '');
    const c = n.counts;
    v.counts.textContent = `free ${c.free} · poisoned ${c.poisoned} · private ${c.private} · ` +
      `cached ${c.cached} · leased ${c.leased} · release pending ${c.release_pending} · ` +
      `map taken in ${fmt(n.snapshot_us_last, 1)} µs (max ${fmt(n.snapshot_us_max, 1)} µs), ` +
      `${fmt(n.map_age_ms)} ms ago`;
    const cellsN = n.state.length;
    while (v.cells.length < cellsN) {
      const cell = el('div', 'cell');
      cell.dataset.index = String(v.cells.length);
      v.grid.append(cell);
      v.cells.push(cell);
      v.keys.push('');
    }
    while (v.cells.length > cellsN) {
      v.cells.pop().remove();
      v.keys.pop();
    }
    for (let i = 0; i < cellsN; i++) {
      const s = n.state[i];
      const label = n.label[i];
      const key = `${s}|${label}|${n.epoch[i]}|${n.written[i]}|${n.request[i]}`;
      if (v.keys[i] === key) continue;
      v.keys[i] = key;
      const cell = v.cells[i];
      cell.className = 'cell s-' + (s === '.' ? 'f' : s);
      cell.dataset.state = STATES[s] || s;
      cell.dataset.label = label < 0 ? '' : labels[label].name;
      cell.style.backgroundColor = colour(label);
      cell.style.color = colour(label);
      const first = i * n.pages_per_cell;
      const who = label < 0 ? '' : ` · ${labels[label].name}`;
      const req = n.request[i] !== null ? ` · request ${n.request[i]}` : '';
      const fill = s === '.' || s === 'p' ? '' : ` · ${n.written[i]}/${n.page_size_tokens} slots written`;
      cell.title = (n.pages_per_cell > 1 ? `pages ${first}–${first + n.pages_per_cell - 1}` : `page ${first}`) +
        ` · ${STATES[s] || s}${who}${req} · epoch ${n.epoch[i]}${fill}`;
      let bar = cell.firstChild;
      const part = s === 'o' && n.written[i] < n.page_size_tokens ? n.written[i] / n.page_size_tokens : 0;
      if (part > 0) {
        if (!bar) { bar = el('span', 'fill'); cell.append(bar); }
        bar.style.height = (part * 100).toFixed(0) + '%';
      } else if (bar) {
        bar.remove();
      }
    }
    v.transfers.replaceChildren();
    if (n.transfers.length) {
      const t = el('table');
      const head = el('tr');
      for (const h of ['request', 'tenant', 'from', 'to', 'phase', 'pages']) head.append(el('th', '', h));
      t.append(head);
      for (const x of n.transfers) {
        const row = el('tr');
        row.dataset.request = x.request;
        const pages = el('td');
        const bar = el('span', 'bar');
        const fill = el('i');
        fill.style.width = (x.pages_total ? x.pages_done / x.pages_total * 100 : 0).toFixed(0) + '%';
        bar.append(fill);
        pages.append(bar, document.createTextNode(` ${x.pages_done}/${x.pages_total}`));
        row.append(el('td', '', x.request), el('td', '', x.tenant), el('td', '', x.from),
          el('td', '', x.to), el('td', '', x.phase), pages);
        t.append(row);
      }
      v.transfers.append(el('div', 'muted', 'transfers in flight'), t);
    } else if (n.role === 'prefill' || n.role === 'decode') {
      v.transfers.append(el('div', 'empty', 'no transfer in flight'));
    }
  }

  function draw(snap) {
    $('meta').textContent = `${snap.model} · ${snap.mode} · up ${snap.uptime_s} s · ` +
      `pool map cost ≤ ${fmt(snap.snapshot_us_max, 1)} µs`;
    drawSafety(snap.safety);
    drawTenants(snap);
    for (const n of snap.nodes) drawNode(n, snap.labels);
    $('no-nodes').hidden = snap.nodes.length > 0;
    document.body.dataset.updated = String(Date.now());
  }

  async function poll() {
    const started = Date.now();
    try {
      const r = await fetch('/console/snapshot', { credentials: 'same-origin', cache: 'no-store' });
      if (r.status === 401 || r.status === 403) {
        const body = await r.json().catch(() => null);
        status(body && body.error ? body.error.message : 'not authorised', 'error');
        return; // no retry: the operator must reload with the key
      }
      if (!r.ok) throw new Error('HTTP ' + r.status);
      draw(await r.json());
      failures = 0;
      status('live · ' + new Date().toLocaleTimeString(), 'live');
    } catch (e) {
      failures += 1;
      status(`no answer (${failures}) · retrying`, 'error');
    }
    const wait = Math.max(POLL_MS - (Date.now() - started), 0) + Math.min(failures, 10) * POLL_MS;
    setTimeout(poll, wait);
  }

  document.addEventListener('DOMContentLoaded', () => {
    legend();
    poll();
  });
}());
