// The jobfold operator console: one page over the HTTP API beside it.
//
// Everything shown is set as text (textContent, createTextNode), never parsed as markup:
// inputs, document ids and errors are user data. The API token, when one is needed, is kept
// in this tab's session storage and sent only as an Authorization header. What the signed-in
// role may not do is hidden (`data-needs` on the control, the role on <body>); the API
// refuses it anyway.
'use strict';

const TOKEN_KEY = 'jobfold.apiToken';
const WHO_KEY = 'jobfold.apiWho';
const ROLES = ['read', 'submit', 'operate', 'admin'];
const OVERVIEW_EVERY_MS = 2000;
const JOB_EVERY_MS = 2000;
const PREVIEW_CHARS = 4096;
const HISTORY_MINUTES = 60;
const HISTORY_EVERY_MS = 30000;
const STATES = ['queued', 'leased', 'retry_wait', 'succeeded', 'quarantined', 'superseded', 'cancelled'];
const OPEN_STATES = new Set(['queued', 'leased', 'retry_wait']);
const UUID = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

const app = {
  tokenRequired: false,
  // Bumped on every navigation: a refresh loop of an earlier page sees it changed and stops.
  page: 0,
};

// ---- DOM helpers -------------------------------------------------------------------------

// Characters that change how text reads without showing themselves: bidirectional controls
// (a right-to-left override shows `invoice\u202Egpj.exe` as "invoiceexe.jpg"), zero-width
// and other invisible characters, C0 and C1 controls but tab and newline.
const HIDDEN = /[\u0000-\u0008\u000B-\u001F\u007F-\u009F\u00AD\u061C\u180E\u200B-\u200F\u202A-\u202E\u2060-\u2064\u2066-\u206F\uFEFF\uFFF9-\uFFFB]/g;

/** `text` with each hidden character shown as its code point: ⟦U+202E⟧. */
function visible(text) {
  return String(text).replace(HIDDEN, (c) => `⟦U+${c.codePointAt(0).toString(16).toUpperCase().padStart(4, '0')}⟧`);
}

/** An element; `attrs.text` sets its text (hidden characters shown), `on*` adds listeners,
 * the rest are attributes. */
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === 'text') node.textContent = visible(value);
    else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? '' : String(value));
  }
  append(node, children);
  return node;
}

function append(node, children) {
  for (const child of [children].flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(visible(child)));
  }
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  return node;
}

const main = () => document.getElementById('main');

function toast(message, kind) {
  const box = document.getElementById('toast');
  box.textContent = message;
  box.className = 'toast shown' + (kind === 'error' ? ' error' : '');
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => { box.className = 'toast'; }, 6000);
}

// ---- Formatting --------------------------------------------------------------------------

const count = (n) => (n === null || n === undefined ? '–' : Number(n).toLocaleString('en-US'));

function rate(perSecond) {
  if (perSecond === null || perSecond === undefined) return '–';
  return perSecond >= 10 ? Math.round(perSecond).toLocaleString('en-US') : perSecond.toFixed(1);
}

function age(seconds) {
  if (seconds === null || seconds === undefined) return '–';
  if (seconds < 10) return `${seconds.toFixed(1)} s`;
  if (seconds < 120) return `${Math.round(seconds)} s`;
  if (seconds < 7200) return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
  if (seconds < 172800) return `${Math.floor(seconds / 3600)} h ${Math.round((seconds % 3600) / 60)} min`;
  return `${Math.round(seconds / 86400)} d`;
}

function time(iso) {
  if (!iso) return '–';
  const t = new Date(iso);
  return Number.isNaN(t.getTime()) ? String(iso) : t.toISOString().replace('T', ' ').slice(0, 23) + 'Z';
}

function millis(ms) {
  return ms < 1000 ? `${Math.round(ms)} ms` : age(ms / 1000);
}

function stateBadge(state) {
  return el('span', { class: `badge state-${state}`, 'data-state': state, text: state.replace('_', ' ') });
}

// ---- The API -----------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

/** Calls the API with the token, if signed in. Throws an ApiError on anything but 2xx. */
async function api(method, path, body) {
  const headers = { Accept: 'application/json' };
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  let response;
  try {
    response = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: 'omit',
      cache: 'no-store',
    });
  } catch (e) {
    throw new ApiError(0, 'unreachable', 'the processor does not answer');
  }
  const text = await response.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch (e) { data = text; }
  if (response.ok) return { status: response.status, data, text };
  const error = (data && data.error) || {};
  if (response.status === 401) {
    signOut();
    app.tokenRequired = true;
    renderSession();
    showLogin('This processor needs an API token: sign in, then try again.');
  }
  throw new ApiError(response.status, error.code || 'http_' + response.status,
    error.message || `the API answered ${response.status}`);
}

// ---- Sign-in -----------------------------------------------------------------------------

/** Who signed in: the token's name and role, or null. */
function who() {
  try { return JSON.parse(sessionStorage.getItem(WHO_KEY) || 'null'); } catch (e) { return null; }
}

function signOut() {
  sessionStorage.removeItem(TOKEN_KEY);
  sessionStorage.removeItem(WHO_KEY);
}

/** The role the page acts with: every role on an API without tokens; none signed out. */
function role() {
  if (!app.tokenRequired) return 'admin';
  const signed = who();
  return signed && ROLES.includes(signed.role) ? signed.role : 'none';
}

function renderSession() {
  const signed = sessionStorage.getItem(TOKEN_KEY) ? who() : null;
  const label = document.getElementById('session-state');
  label.textContent = !app.tokenRequired ? 'No API token set: everything is open'
    : signed ? `Signed in as ${signed.name} (${signed.role})` : 'Signed out';
  document.body.dataset.role = role();
  document.getElementById('sign-in-open').hidden = !app.tokenRequired || Boolean(signed);
  document.getElementById('sign-out').hidden = !app.tokenRequired || !signed;
}

function showLogin(why) {
  const panel = document.getElementById('login');
  document.getElementById('login-why').textContent = why || 'Sign in with an API token of this processor.';
  document.getElementById('login-error').textContent = '';
  panel.hidden = false;
  document.getElementById('login-token').focus();
}

function hideLogin() {
  document.getElementById('login').hidden = true;
  document.getElementById('login-token').value = '';
}

async function signIn(event) {
  event.preventDefault();
  const input = document.getElementById('login-token');
  const token = input.value.trim();
  const error = document.getElementById('login-error');
  if (!token) return;
  let response;
  try {
    response = await fetch('/v1/auth', {
      method: 'POST',
      headers: { Authorization: `Bearer ${token}` },
      credentials: 'omit',
      cache: 'no-store',
    });
  } catch (e) {
    error.textContent = 'The processor does not answer.';
    return;
  }
  if (response.status === 200) {
    const data = await response.json();
    sessionStorage.setItem(TOKEN_KEY, token);
    sessionStorage.setItem(WHO_KEY, JSON.stringify({ name: data.name, role: data.role }));
    app.tokenRequired = data.token_required;
    hideLogin();
    renderSession();
    toast(`Signed in as ${data.name} (${data.role}).`);
    route();
  } else if (response.status === 401) {
    error.textContent = 'That is not a token of this processor.';
    input.select();
  } else if (response.status === 429) {
    error.textContent = 'Too many failed sign-ins from this address: wait a minute.';
  } else {
    error.textContent = `Signing in failed (${response.status}).`;
  }
}

// ---- Pages -------------------------------------------------------------------------------

function route() {
  app.page += 1;
  const hash = location.hash || '#/';
  const [path, query] = hash.slice(1).split('?');
  const params = new URLSearchParams(query || '');
  const parts = path.split('/').filter(Boolean).map((part) => {
    try { return decodeURIComponent(part); } catch (e) { return part; }
  });
  const section = parts[0] || 'overview';
  for (const link of document.querySelectorAll('[data-nav]')) {
    if (link.dataset.nav === section) link.setAttribute('aria-current', 'page');
    else link.removeAttribute('aria-current');
  }
  main().replaceChildren();
  if (section === 'overview') overviewPage();
  else if (section === 'jobs' && parts[1]) jobPage(parts[1]);
  else if (section === 'jobs') jobsPage(params);
  else if (section === 'kinds' && parts[1]) kindPage(parts[1]);
  else if (section === 'kinds') kindsPage();
  else if (section === 'processors') processorsPage();
  else if (section === 'quarantine') quarantinePage(params);
  else if (section === 'dead-letters' && parts[1]) deadLetterPage(parts[1]);
  else if (section === 'dead-letters') deadLettersPage(params);
  else if (section === 'audit') auditPage(params);
  else append(main(), [el('h1', { text: 'Not found' }), el('p', { text: 'No such page.' })]);
}

/** Runs `step` now and then every `ms` while this page is shown (no overlapping runs). */
function every(ms, step) {
  const page = app.page;
  const loop = async () => {
    if (app.page !== page) return;
    const keep = await step();
    if (keep !== false && app.page === page) setTimeout(loop, ms);
  };
  loop();
}

function errorLine(id) {
  return el('p', { id, class: 'error', role: 'alert' });
}

function showError(id, e) {
  const line = document.getElementById(id);
  if (line) line.textContent = e ? `${e.message}${e.status ? ` (${e.status})` : ''}` : '';
}

function table(label, columns, id) {
  return el('div', { class: 'scroll' },
    el('table', { 'aria-label': label },
      el('thead', {}, el('tr', {}, columns.map((c) => el('th', { scope: 'col', text: c })))),
      el('tbody', { id })));
}

function form(id, fields, submitLabel, onsubmit) {
  return el('form', { id, class: 'filters', onsubmit: (e) => { e.preventDefault(); onsubmit(new FormData(e.target)); } },
    fields.map(([name, label, kind, value, options]) => el('label', {},
      el('span', { text: label }),
      kind === 'select'
        ? el('select', { name }, options.map((o) => el('option', { value: o, selected: o === value, text: o || 'any' })))
        : el('input', { name, type: kind || 'text', value: value || '' }))),
    el('button', { type: 'submit', text: submitLabel }));
}

/** The form's non-empty fields as a query string; datetime-local fields as UTC times. */
function queryOf(data) {
  const query = new URLSearchParams();
  for (const [key, value] of data.entries()) {
    const text = String(value).trim();
    if (!text) continue;
    query.set(key, /^\d{4}-\d\d-\d\dT\d\d:\d\d/.test(text) && !text.endsWith('Z')
      ? new Date(text).toISOString() : text);
  }
  return query;
}

function localInput(iso) {
  if (!iso) return '';
  const t = new Date(iso);
  if (Number.isNaN(t.getTime())) return '';
  const local = new Date(t.getTime() - t.getTimezoneOffset() * 60000);
  return local.toISOString().slice(0, 16);
}

// -- Overview --

const TILES = [
  ['unfinished', 'Unfinished jobs', (o) => count(o.unfinished)],
  ['oldest_queued_age_seconds', 'Oldest queued', (o) => age(o.oldest_queued_age_seconds)],
  ['accepted_per_second', 'Accepted / s', (o) => rate(o.rates.accepted_per_second), 'accepted'],
  ['succeeded_per_second', 'Succeeded / s', (o) => rate(o.rates.succeeded_per_second), 'succeeded'],
  ['expired_leases', 'Expired leases', (o) => count(o.expired_leases)],
  ['scheduled', 'Scheduled', (o) => count(o.scheduled)],
  ['quarantined_total', 'Quarantined', (o) => count(o.quarantined_total), null, '#/quarantine'],
  ['dead_letters', 'Dead letters', (o) => count(o.dead_letters), null, '#/dead-letters'],
  ['relay_backlog', 'Relay backlog', (o) => count(o.relay_backlog), 'backlog'],
  ['relay_oldest_unpublished_age_seconds', 'Relay owes since', (o) => age(o.relay_oldest_unpublished_age_seconds)],
  ['relay_parked', 'Parked events', (o) => count(o.relay_parked)],
];

function overviewPage() {
  const tiles = TILES.map(([key, label, , chart, link]) => el('div', { class: 'tile', 'data-tile': key },
    link ? el('a', { href: link, class: 'tile-label', text: label }) : el('span', { class: 'tile-label', text: label }),
    el('span', { class: 'tile-value', 'data-metric': key, text: '–' }),
    chart ? el('span', { class: 'spark', 'data-chart': chart, 'aria-hidden': 'true' }) : el('span', { class: 'tile-note', 'data-note': key })));
  append(main(), [
    el('div', { class: 'page-head' },
      el('h1', { text: 'Overview' }),
      el('span', { class: 'updated', id: 'updated', 'aria-live': 'off', text: 'loading…' })),
    errorLine('overview-error'),
    el('section', { class: 'tiles', 'aria-label': 'Figures' }, tiles),
    el('p', { class: 'note', id: 'history-note', text: 'Charts: per minute, the last hour.' }),
    el('div', { class: 'columns' },
      el('section', { 'aria-labelledby': 'owners-title' },
        el('h2', { id: 'owners-title', text: 'Quarantined by owner' }),
        table('Quarantined jobs by owner', ['Owner', 'Jobs'], 'owners')),
      el('section', { 'aria-labelledby': 'lag-title' },
        el('h2', { id: 'lag-title', text: 'Consumer lag' }),
        el('p', { class: 'note', id: 'lag-error' }),
        el('div', { id: 'lag' }))),
  ]);
  every(HISTORY_EVERY_MS, async () => {
    try {
      const { data } = await api('GET', `/v1/history?minutes=${HISTORY_MINUTES}`);
      renderHistory(data.points);
    } catch (e) {
      showError('overview-error', e);
    }
  });
  every(OVERVIEW_EVERY_MS, async () => {
    try {
      const { data } = await api('GET', '/v1/overview');
      renderOverview(data);
      showError('overview-error', null);
    } catch (e) {
      showError('overview-error', e);
    }
  });
}

function renderOverview(o) {
  app.traceUrl = o.trace_url || null;
  if (app.tokenRequired !== o.token_required) {
    app.tokenRequired = o.token_required;
    renderSession();
  }
  for (const [key, , show] of TILES) {
    const value = document.querySelector(`[data-metric="${key}"]`);
    if (value) value.textContent = show(o);
  }
  const note = (key, text) => {
    const node = document.querySelector(`[data-note="${key}"]`);
    if (node) node.textContent = text;
  };
  note('unfinished', `${count(o.jobs.queued)} queued · ${count(o.jobs.leased)} leased · ${count(o.jobs.retry_wait)} retry`);
  const owners = Object.keys(o.quarantined).length;
  note('quarantined_total', owners === 1 ? '1 owner' : `${count(owners)} owners`);
  note('expired_leases', o.expired_leases ? 'their workers died or stalled' : 'none');
  note('scheduled', 'waiting for their time');
  note('dead_letters', 'undecodable messages');
  note('oldest_queued_age_seconds', 'since it became due');
  note('relay_oldest_unpublished_age_seconds', 'oldest event not on Kafka');
  note('relay_parked', o.relay_parked ? 'Kafka refuses them: jobfold parked list' : 'none');

  document.getElementById('owners').replaceChildren(...(Object.keys(o.quarantined).length
    ? Object.entries(o.quarantined).map(([owner, n]) => el('tr', {},
      el('td', {}, el('a', { href: '#/quarantine?' + new URLSearchParams({ owner }), text: owner })),
      el('td', { class: 'num', 'data-owner': owner, text: count(n) })))
    : [el('tr', {}, el('td', { colspan: 2, class: 'empty', text: 'Nothing quarantined.' }))]));
  document.getElementById('lag-error').textContent = o.consumer_lag_error ? `Kafka did not answer: ${o.consumer_lag_error}` : '';
  const groups = new Map();
  for (const l of o.consumer_lag) {
    const key = `${l.group} ${l.topic}`;
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(l);
  }
  document.getElementById('lag').replaceChildren(...(groups.size ? [...groups.values()].map((partitions) => {
    const total = partitions.reduce((sum, l) => sum + l.lag, 0);
    return el('div', { class: 'lag-group' },
      el('p', { class: 'lag-title' }, el('span', { class: 'mono', text: partitions[0].group }), ' on ',
        el('span', { class: 'mono', text: partitions[0].topic }), ` · ${count(total)} behind`),
      el('div', { class: 'scroll' }, el('table', { 'aria-label': `Lag of ${partitions[0].group}` },
        el('thead', {}, el('tr', {}, ['Partition', 'Committed', 'End', 'Lag'].map((c) => el('th', { scope: 'col', class: 'num', text: c })))),
        el('tbody', {}, partitions.map((l) => el('tr', { 'data-lag': `${l.topic}/${l.partition}` },
          el('td', { class: 'num', text: l.partition }),
          el('td', { class: 'num', text: l.committed === null ? 'none' : count(l.committed) }),
          el('td', { class: 'num', text: count(l.end) }),
          el('td', { class: 'num lag', text: count(l.lag) })))))));
  }) : [el('p', { class: 'note', text: 'No partitions.' })]));
  document.getElementById('updated').textContent = `Updated ${time(o.at).slice(11)} · every ${OVERVIEW_EVERY_MS / 1000} s`;
}

/** The charts from the recorded minutes (kept in Postgres: a reload shows the same). */
function renderHistory(points) {
  const end = Math.floor(Date.now() / 60000);
  const byMinute = new Map(points.map((p) => [Math.floor(new Date(p.minute).getTime() / 60000), p]));
  // One value a minute from HISTORY_MINUTES ago to now; a minute nobody recorded is a gap.
  const minutes = Array.from({ length: HISTORY_MINUTES }, (_, i) => byMinute.get(end - HISTORY_MINUTES + 1 + i));
  const series = {
    accepted: minutes.map((p) => (p ? p.accepted / 60 : null)),
    succeeded: minutes.map((p) => (p ? p.succeeded / 60 : null)),
    backlog: minutes.map((p) => (p && p.relay_backlog !== null ? p.relay_backlog : null)),
  };
  for (const chart of document.querySelectorAll('[data-chart]')) drawSpark(chart, series[chart.dataset.chart]);
  const first = points.length ? (Date.now() - new Date(points[0].minute).getTime()) / 1000 : null;
  const note = document.getElementById('history-note');
  if (note) {
    note.dataset.points = String(points.length);
    note.textContent = points.length
      ? `Charts: per minute, from ${HISTORY_MINUTES} min ago to now (${count(points.length)} ${points.length === 1 ? 'minute' : 'minutes'} recorded, the oldest ${ago(first)}).`
      : 'Charts: per minute, the last hour — nothing recorded yet (each processor writes a minute once it is over).';
  }
}

/** A line over `values` (one a minute, oldest left, `null` where none was recorded). */
function drawSpark(host, values) {
  const width = 120;
  const height = 28;
  const known = values.filter((v) => v !== null);
  const max = Math.max(1, ...known);
  const step = width / Math.max(1, values.length - 1);
  const at = (v, i) => `${(i * step).toFixed(1)},${(height - 1 - (v / max) * (height - 2)).toFixed(1)}`;
  const chart = svg('svg', { viewBox: `0 0 ${width} ${height}`, width, height, focusable: 'false' });
  // Each run of recorded minutes is a line of its own; a lone minute, a dot.
  let run = [];
  const flush = () => {
    if (run.length === 1) {
      const [x, y] = run[0].split(',');
      chart.append(svg('circle', { cx: x, cy: y, r: 1.5, fill: 'currentColor' }));
    } else if (run.length > 1) {
      chart.append(svg('polyline', { points: run.join(' '), fill: 'none', stroke: 'currentColor', 'stroke-width': 1.5 }));
    }
    run = [];
  };
  values.forEach((v, i) => {
    if (v === null) flush();
    else run.push(at(v, i));
  });
  flush();
  host.replaceChildren(chart);
  host.dataset.points = String(known.length);
  host.title = known.length
    ? `per minute, ${values.length} min ago to now: highest ${rate(max)}, now ${rate(values[values.length - 1])}`
    : 'nothing recorded in the last hour';
}

// -- Jobs --

function jobsPage(params) {
  const order = params.get('order') || 'desc';
  append(main(), [
    el('h1', { text: 'Jobs' }),
    form('job-search', [
      ['q', 'Job id or document', 'search', params.get('document_id') || ''],
      ['kind', 'Kind', 'text', params.get('kind')],
      ['state', 'State', 'select', params.get('state') || '', [''].concat(STATES)],
      ['since', 'Accepted since', 'datetime-local', localInput(params.get('since'))],
    ], 'Search', async (data) => {
      const q = String(data.get('q') || '').trim();
      data.delete('q');
      if (UUID.test(q)) {
        try {
          await api('GET', `/v1/jobs/${q}`);
          location.hash = `#/jobs/${q}`;
          return;
        } catch (e) { /* not a job id: a document */ }
      }
      const query = queryOf(data);
      if (q) query.set('document_id', q);
      location.hash = '#/jobs?' + query;
    }),
    el('nav', { class: 'actions', 'aria-label': 'Lists' },
      el('a', { href: '#/jobs', 'aria-current': !params.toString() ? 'page' : null, text: 'All' }),
      el('a', { href: '#/jobs?state=retry_wait', id: 'list-retry', 'aria-current': params.get('state') === 'retry_wait' ? 'page' : null, text: 'Waiting to retry' }),
      el('a', { href: '#/jobs?scheduled=true', id: 'list-scheduled', 'aria-current': params.get('scheduled') ? 'page' : null, text: 'Scheduled' })),
    bulkCancelBar(params),
    errorLine('jobs-error'),
    table('Jobs', ['Job', 'Document', 'Kind', 'Version', 'State', 'Attempt', 'Accepted', ''], 'jobs'),
    el('button', { type: 'button', id: 'jobs-more', class: 'secondary', hidden: true, text: 'Next page' }),
  ]);
  const query = new URLSearchParams(params);
  query.set('order', order);
  query.set('limit', '50');
  const body = document.getElementById('jobs');
  const more = document.getElementById('jobs-more');
  const load = async (after) => {
    if (after) query.set('after', after);
    try {
      const { data } = await api('GET', '/v1/jobs?' + query);
      if (!after && !data.jobs.length) body.append(el('tr', {}, el('td', { colspan: 8, class: 'empty', text: 'No job matches.' })));
      for (const job of data.jobs) body.append(jobRow(job));
      more.hidden = !data.next;
      more.onclick = () => load(data.next);
      showError('jobs-error', null);
    } catch (e) {
      showError('jobs-error', e);
    }
  };
  load(null);
}

/** Whether `job` waits for a time (scheduled, or its retry): run now brings it forward. */
function waitsForTime(job) {
  return job.state === 'retry_wait' || (job.state === 'queued' && job.run_at && new Date(job.run_at) > new Date());
}

/** The jobs page's bulk cancel for its filter, counted first (a dry run), then confirmed;
 * nothing without a filter, nor for a list the bulk cancel cannot select (scheduled). */
function bulkCancelBar(params) {
  const filter = {};
  for (const key of ['kind', 'document_id', 'state', 'since']) if (params.get(key)) filter[key] = params.get(key);
  if (!Object.keys(filter).length || params.get('scheduled') || (filter.state && !OPEN_STATES.has(filter.state))) return null;
  const ask = el('span', { class: 'ask', id: 'cancel-ask', hidden: true });
  const countMatching = async () => {
    let counted;
    try {
      ({ data: counted } = await api('POST', '/v1/jobs/cancel', { ...filter, dry_run: true }));
    } catch (e) {
      toast(`Refused: ${e.message}${e.status ? ` (${e.status})` : ''}`, 'error');
      return;
    }
    ask.replaceChildren(
      el('span', { id: 'cancel-matched', 'data-matched': counted.matched, text: `${count(counted.matched)} open jobs match this filter. Cancel them all?` }),
      counted.matched ? el('button', { type: 'button', id: 'cancel-all-yes', class: 'danger', text: `Cancel ${count(counted.matched)} jobs`,
        onclick: () => act('POST', '/v1/jobs/cancel', { ...filter, reason: 'cancelled from the console' },
          (d) => `Cancelled ${count(d.cancelled)} of ${count(d.matched)}${d.remaining ? `; ${count(d.remaining)} still match: cancel again` : ''}.`) }) : null,
      el('button', { type: 'button', class: 'secondary', text: 'Never mind', onclick: () => { ask.hidden = true; } }));
    ask.hidden = false;
    (ask.querySelector('#cancel-all-yes') || ask.querySelector('button')).focus();
  };
  return el('div', { class: 'actions', 'data-needs': 'operate' },
    el('button', { type: 'button', id: 'cancel-count', class: 'secondary', text: 'Cancel all that match…', onclick: countMatching }),
    ask);
}

function jobRow(job) {
  return el('tr', { 'data-job': job.job_id },
    el('td', { class: 'mono' }, el('a', { href: `#/jobs/${job.job_id}`, text: job.job_id })),
    el('td', {}, el('a', { href: '#/jobs?' + new URLSearchParams({ document_id: job.document_id }), class: 'doc', text: job.document_id })),
    el('td', { text: job.kind }),
    el('td', { class: 'num', text: job.input_version }),
    el('td', {}, stateBadge(job.state)),
    el('td', { class: 'num', text: `${job.attempt}/${job.max_attempts}` }),
    el('td', { class: 'time', text: time(job.accepted_at) }),
    el('td', {}, waitsForTime(job)
      ? el('button', { type: 'button', class: 'small', 'data-needs': 'operate', 'data-run-now': job.job_id,
        title: job.state === 'retry_wait' ? `retry due ${time(job.next_attempt_at)}` : `due ${time(job.run_at)}`, text: 'Run now',
        onclick: () => act('POST', `/v1/jobs/${job.job_id}/run-now`, undefined, 'Due now: it is dispatched at once.') })
      : null));
}

// -- One job --

function jobPage(id) {
  append(main(), [
    el('div', { class: 'page-head' },
      el('h1', {}, 'Job ', el('span', { class: 'mono', text: id })),
      el('span', { id: 'job-state' })),
    errorLine('job-error'),
    el('div', { class: 'actions', id: 'job-actions' }),
    el('section', { 'aria-labelledby': 'summary-title' },
      el('h2', { id: 'summary-title', text: 'Summary' }),
      el('dl', { class: 'summary', id: 'job-summary' })),
    el('section', { 'aria-labelledby': 'timeline-title' },
      el('h2', { id: 'timeline-title', text: 'Events' }),
      table('Event timeline', ['#', 'Event', 'At', 'Attempt', 'Generation', 'Duration', 'Details'], 'job-events')),
    el('div', { class: 'columns' },
      payloadPanel('input', 'Input', id),
      payloadPanel('result', 'Result', id)),
  ]);
  let shownState = null;
  every(JOB_EVERY_MS, async () => {
    try {
      const [{ data: job }, { data: events }] = await Promise.all([
        api('GET', `/v1/jobs/${encodeURIComponent(id)}`),
        api('GET', `/v1/jobs/${encodeURIComponent(id)}/events`),
      ]);
      renderJob(job, events, shownState !== job.state);
      if (shownState !== job.state) {
        shownState = job.state;
        loadPayload('input', id);
        loadPayload('result', id);
      }
      showError('job-error', null);
      return OPEN_STATES.has(job.state);
    } catch (e) {
      showError('job-error', e);
      return e.status !== 404;
    }
  });
}

function payloadPanel(which, title, id) {
  return el('section', { 'aria-labelledby': `${which}-title` },
    el('h2', { id: `${which}-title` }, title, ' ',
      el('a', { href: '#', hidden: true, class: 'download', download: `${id}-${which}.json`, id: `${which}-download`, text: 'Download' })),
    el('p', { class: 'note', id: `${which}-note` }),
    el('pre', { id: `${which}-text`, tabindex: 0 }));
}

async function loadPayload(which, id) {
  const pre = document.getElementById(`${which}-text`);
  const note = document.getElementById(`${which}-note`);
  const link = document.getElementById(`${which}-download`);
  try {
    const { text } = await api('GET', `/v1/jobs/${encodeURIComponent(id)}/${which}`);
    const truncated = text.length > PREVIEW_CHARS;
    pre.textContent = visible(truncated ? text.slice(0, PREVIEW_CHARS) + '\n…' : text);
    note.textContent = truncated ? `Showing the first ${count(PREVIEW_CHARS)} of ${count(text.length)} characters: download it for the rest.` : '';
    // Saved from what was read with the token: a plain link would be fetched without it.
    if (link.href.startsWith('blob:')) URL.revokeObjectURL(link.href);
    link.href = URL.createObjectURL(new Blob([text], { type: 'application/json' }));
    link.dataset.chars = String(text.length);
    link.hidden = false;
  } catch (e) {
    pre.textContent = '';
    note.textContent = e.code === 'no_result' ? 'No result committed.' : e.message;
    link.hidden = true;
  }
}

function renderJob(job, events, stateChanged) {
  document.getElementById('job-state').replaceChildren(stateBadge(job.state));
  const trace = events.map((e) => e.event.trace && e.event.trace.traceparent).find(Boolean);
  const rows = [
    ['Document', el('a', { href: '#/jobs?' + new URLSearchParams({ document_id: job.document_id }), class: 'doc', text: job.document_id })],
    ['Kind', job.kind],
    ['Input version', job.input_version],
    ['State', stateBadge(job.state)],
    ['Attempts', `${job.attempt} of ${job.max_attempts}`],
    ['Generation', job.generation],
    ['Accepted', time(job.accepted_at)],
    job.run_at && ['Due', time(job.run_at)],
    job.lease_owner && ['Lease', `${job.lease_owner} until ${time(job.lease_until)}`],
    // A handler over HTTP that answered 202 reports its progress in its heartbeats.
    job.progress != null && ['Progress', el('span', { class: 'mono', 'data-field': 'progress', text: `${JSON.stringify(job.progress).slice(0, 300)} at ${time(job.progress_at)}` })],
    job.next_attempt_at && ['Next attempt', time(job.next_attempt_at)],
    job.previous_outcome && ['Last attempt ended', el('span', { 'data-field': 'previous_outcome', text: job.previous_outcome === 'ambiguous' ? 'outcome unknown: its effects may have happened (the next attempt is told)' : 'failed' })],
    job.deadline && ['Deadline', time(job.deadline)],
    job.finished_at && ['Finished', time(job.finished_at)],
    // The quarantine reason repeats the last error: shown once.
    job.last_error && !(job.quarantine_reason || '').includes(job.last_error) && ['Last error', el('span', { class: 'error-text', text: job.last_error })],
    job.quarantine_reason && ['Quarantined because', el('span', { class: 'error-text', 'data-field': 'quarantine_reason', text: job.quarantine_reason })],
    job.quarantine_owner && ['Owner', job.quarantine_owner],
    job.idempotency_key && ['Idempotency key', job.idempotency_key],
    ['Trace', trace ? traceLink(trace.split('-')[1] || trace) : 'none'],
  ].filter(Boolean);
  document.getElementById('job-summary').replaceChildren(...rows.flatMap(([term, value]) => [
    el('dt', { text: term }), el('dd', {}, value instanceof Node ? value : String(value))]));
  renderTimeline(events);
  if (stateChanged) renderJobActions(job);
}

/** A trace id, a link where `console.trace_url` is configured. */
function traceLink(traceId) {
  if (!app.traceUrl || !/^[0-9a-f]{32}$/.test(traceId)) return el('span', { class: 'mono', 'data-field': 'trace_id', text: traceId });
  return el('a', { class: 'mono', 'data-field': 'trace_id', href: app.traceUrl.replace('{trace_id}', traceId), target: '_blank', rel: 'noopener noreferrer', text: traceId });
}

function renderTimeline(events) {
  let leasedAt = null;
  let previousAt = null;
  let lastError = null;
  const rows = events.map((entry) => {
    const payload = entry.event.payload || {};
    const at = new Date(entry.occurred_at).getTime();
    let took = '';
    if (payload.type === 'JobLeased') {
      // How long it waited for a worker (or for its retry or due time).
      if (previousAt !== null) took = `waited ${millis(at - previousAt)}`;
      leasedAt = at;
    } else if (payload.type === 'JobSucceeded' && payload.lease) {
      // Its run ended inside its lease transaction: the success says its own lease.
      const leased = new Date(payload.lease.leased_at).getTime();
      took = `${previousAt !== null ? `waited ${millis(leased - previousAt)} · ` : ''}${millis(at - leased)}`;
      leasedAt = null;
    } else if (leasedAt !== null && ['JobSucceeded', 'JobFailed', 'JobQuarantined', 'JobCancelled'].includes(payload.type)) {
      took = millis(at - leasedAt);
      leasedAt = null;
    }
    previousAt = at;
    const details = Object.entries(payload)
      .filter(([key, value]) => !['type', 'attempt', 'generation'].includes(key) && value !== null)
      .map(([key, value]) => {
        if (key === 'lease') return `leased by ${value.lease_owner} at ${time(value.leased_at)}, in the same transaction`;
        let text = typeof value === 'object' ? JSON.stringify(value) : String(value);
        // A quarantine's reason repeats the failure before it: said once.
        if (key === 'reason' && lastError && text.includes(lastError)) text = text.replace(lastError, '(the failure above)');
        if (key === 'message' || key === 'error') lastError = text;
        return `${key}: ${text}`;
      })
      .join(' · ');
    return el('tr', { 'data-event': payload.type || entry.kind },
      el('td', { class: 'num', text: entry.stream_version }),
      el('td', {}, el('span', { class: 'event', text: payload.type || entry.kind }),
        entry.published ? null : el('span', { class: 'note', text: ' (not on Kafka yet)' })),
      el('td', { class: 'time', text: time(entry.occurred_at) }),
      el('td', { class: 'num', text: payload.attempt ?? '' }),
      el('td', { class: 'num', text: payload.generation ?? '' }),
      el('td', { class: 'num', text: took }),
      el('td', { class: 'details', text: details.length > 600 ? details.slice(0, 600) + '…' : details }));
  });
  document.getElementById('job-events').replaceChildren(...rows);
}

function renderJobActions(job) {
  const box = document.getElementById('job-actions');
  box.replaceChildren();
  const id = job.job_id;
  if (job.state === 'quarantined') {
    const version = el('input', { type: 'number', min: job.input_version + 1, id: 'replay-version', name: 'new_input_version' });
    const input = el('textarea', { id: 'replay-input', name: 'new_input', rows: 3, placeholder: '{"text": "…"}' });
    box.fixed = [
      el('button', { type: 'button', id: 'replay', 'data-needs': 'operate', text: 'Replay', onclick: async () => {
        const body = {};
        if (version.value) body.new_input_version = Number(version.value);
        if (input.value.trim()) {
          try { body.new_input = JSON.parse(input.value); } catch (e) { toast('The new input is not JSON.', 'error'); return; }
        }
        await act('POST', `/v1/jobs/${id}/replay`, body, 'Replayed: it runs again with a fresh budget.');
      } }),
      el('details', { 'data-needs': 'operate' }, el('summary', { text: 'Replay with a fixed input' }),
        el('label', {}, el('span', { text: 'New input version' }), version),
        el('label', {}, el('span', { text: 'New input (JSON)' }), input)),
    ];
    append(box, box.fixed[0]);
  }
  if ((job.state === 'queued' && job.run_at && new Date(job.run_at) > new Date()) || job.state === 'retry_wait') {
    append(box, el('button', { type: 'button', id: 'run-now', class: 'secondary', 'data-needs': 'operate', text: 'Run now',
      onclick: () => act('POST', `/v1/jobs/${id}/run-now`, undefined, 'Due now: it is dispatched at once.') }));
  }
  if (OPEN_STATES.has(job.state) || job.state === 'quarantined') {
    append(box, confirmButton('cancel', 'operate', 'Cancel job', 'Cancel this job? A running handler is stopped and nothing it did is committed.',
      'Yes, cancel it', () => act('POST', `/v1/jobs/${id}/cancel`, { requested_by: 'console' }, 'Cancelled.')));
  }
  // The replay's fixed-input form goes under the buttons, not between them.
  if (box.fixed) append(box, box.fixed[1]);
}

/** A button that asks first: the question and a confirming button appear beside it. */
function confirmButton(id, needs, label, question, yes, action) {
  const box = el('span', { class: 'confirm', 'data-needs': needs });
  const open = el('button', { type: 'button', id, class: 'secondary', text: label });
  const ask = el('span', { class: 'ask', hidden: true },
    el('span', { text: question }),
    el('button', { type: 'button', id: `${id}-yes`, class: 'danger', text: yes, onclick: async () => { ask.hidden = true; open.hidden = false; await action(); } }),
    el('button', { type: 'button', class: 'secondary', text: 'No', onclick: () => { ask.hidden = true; open.hidden = false; open.focus(); } }));
  open.addEventListener('click', () => { open.hidden = true; ask.hidden = false; ask.querySelector('button').focus(); });
  return append(box, [open, ask]);
}

/** Does a mutation, says how it went, then shows the page again (or runs `then`). */
async function act(method, path, body, done, then) {
  try {
    const { data } = await api(method, path, body);
    toast(typeof done === 'function' ? done(data) : done);
    (then || route)();
    return true;
  } catch (e) {
    toast(`Refused: ${e.message}${e.status ? ` (${e.status})` : ''}`, 'error');
    return false;
  }
}

// -- Kinds --

function kindsPage() {
  append(main(), [
    el('h1', { text: 'Kinds' }),
    el('p', { class: 'note', text: 'Pausing a kind holds its jobs in every processor: they wait unleased, their attempts unspent, until it resumes; what runs finishes. Periodic jobs are listed below.' }),
    errorLine('kinds-error'),
    el('p', { class: 'note', text: 'Open jobs now; what succeeded, failed and was quarantined, and the wait and run times, over the last hour (each time the upper bound of its histogram bucket).' }),
    table('Kinds', ['Kind', 'State', 'Queued', 'Running', 'Retry', 'Succeeded', 'Failed', 'Quarantined', 'Wait p50 / p99', 'Run p50 / p99', 'Held', 'Paused', ''], 'kinds'),
    el('h2', { text: 'Periodic jobs' }),
    table('Periodic schedules', ['Schedule', 'Kind', 'Pattern', 'Time zone', 'Next tick', 'Last tick', 'Last job or error'], 'periodic'),
  ]);
  every(5000, async () => {
    let data;
    try {
      ({ data } = await api('GET', '/v1/periodic'));
    } catch (e) {
      showError('kinds-error', e);
      return;
    }
    const body = document.getElementById('periodic');
    if (!body) return false;
    body.replaceChildren();
    if (!data.schedules.length) body.append(el('tr', {}, el('td', { colspan: 7, class: 'empty', text: 'No [periodic.<name>] schedules in this processor\'s configuration.' })));
    for (const p of data.schedules) {
      body.append(el('tr', { 'data-schedule': p.name },
        el('td', { text: p.name }), el('td', { text: p.kind }), el('td', { class: 'mono', text: p.cron }),
        el('td', { text: p.time_zone }),
        el('td', { class: 'time', 'data-next': p.next_tick || '', text: p.next_tick ? time(p.next_tick) : '' }),
        el('td', { class: 'time', text: p.last_tick ? time(p.last_tick) : '' }),
        el('td', {}, p.last_error ? el('span', { class: 'error-text', text: p.last_error })
          : p.last_job_id ? el('a', { class: 'mono', href: `#/jobs/${p.last_job_id}`, text: p.last_job_id }) : '')));
    }
  });
  every(5000, async () => {
    let data;
    try {
      ({ data } = await api('GET', '/v1/kinds'));
    } catch (e) {
      showError('kinds-error', e);
      return;
    }
    showError('kinds-error', null);
    const body = document.getElementById('kinds');
    if (!body) return false;
    // A reason being typed is kept: the rows are redrawn only when nothing has the focus there.
    if (body.contains(document.activeElement)) return;
    body.replaceChildren();
    if (!data.kinds.length) body.append(el('tr', {}, el('td', { colspan: 13, class: 'empty', text: 'No kinds registered yet.' })));
    for (const k of data.kinds) {
      const path = `/v1/kinds/${encodeURIComponent(k.kind)}`;
      const reason = el('input', { type: 'text', 'aria-label': `Why pause ${k.kind}`, placeholder: 'why', 'data-reason': k.kind, maxlength: 2000 });
      const action = k.paused
        ? el('button', { type: 'button', class: 'small', 'data-needs': 'operate', 'data-resume': k.kind, text: 'Resume',
          onclick: () => act('POST', `${path}/resume`, { requested_by: 'console' },
            (d) => `Resumed ${d.kind}: ${count(d.dispatched)} waiting ${d.dispatched === 1 ? 'job' : 'jobs'} dispatched again.`) })
        : el('span', { class: 'inline', 'data-needs': 'operate' }, reason,
          el('button', { type: 'button', class: 'small danger', 'data-pause': k.kind, text: 'Pause',
            onclick: () => act('POST', `${path}/pause`, { requested_by: 'console', reason: reason.value.trim() || undefined },
              (d) => `Paused ${d.kind} in every processor.`) }));
      const figure = (key, value, text) => el('td', { class: 'num', [`data-${key}`]: value, text: text === undefined ? count(value) : text });
      body.append(el('tr', { 'data-kind': k.kind },
        el('td', {}, el('a', { href: `#/kinds/${encodeURIComponent(k.kind)}`, text: k.kind })),
        el('td', {}, el('span', { class: `badge ${k.paused ? 'state-quarantined' : 'state-succeeded'}`, 'data-kind-state': k.paused ? 'paused' : 'running', text: k.paused ? 'paused' : 'running' }),
          k.throttle && k.throttle.paused_until ? [' ', el('span', { class: 'badge state-retry_wait', 'data-throttled': k.throttle.paused_until, title: `a provider's 429: paused until ${time(k.throttle.paused_until)}`, text: 'throttled' })] : null),
        figure('queued', k.open.queued),
        figure('running', k.open.leased),
        figure('retry', k.open.retry_wait),
        figure('succeeded', k.ended.succeeded),
        figure('failed', k.ended.failed),
        figure('quarantined', k.ended.quarantined),
        figure('wait', `${k.ended.wait_p50_ms ?? ''}/${k.ended.wait_p99_ms ?? ''}`, `${bound(k.ended.wait_p50_ms)} / ${bound(k.ended.wait_p99_ms)}`),
        figure('run', `${k.ended.run_p50_ms ?? ''}/${k.ended.run_p99_ms ?? ''}`, `${bound(k.ended.run_p50_ms)} / ${bound(k.ended.run_p99_ms)}`),
        el('td', { class: 'num', 'data-waiting': k.waiting, text: count(k.waiting) }),
        el('td', { 'data-paused': k.paused ? 'yes' : 'no' }, k.paused
          ? [el('span', { class: 'time', text: time(k.paused_at) }), ` by ${k.paused_by || 'someone'}`,
            k.reason ? el('span', { class: 'error-text', text: `: ${k.reason}` }) : null]
          : ''),
        el('td', {}, action)));
    }
  });
}

/** A histogram bucket's upper bound: "≤ 250 ms", "> 1 h" past the last one, "–" for none. */
function bound(ms) {
  if (ms === null || ms === undefined) return '–';
  if (ms >= Number.MAX_SAFE_INTEGER) return '> 1 h';
  return `≤ ${ms < 1000 ? `${ms} ms` : age(ms / 1000)}`;
}

function kindPage(name) {
  const path = `/v1/kinds/${encodeURIComponent(name)}`;
  append(main(), [
    el('div', { class: 'page-head' },
      el('h1', {}, 'Kind ', el('span', { class: 'mono', text: name })),
      el('span', { id: 'kind-state' })),
    errorLine('kind-error'),
    el('p', { class: 'actions' },
      el('a', { href: '#/jobs?' + new URLSearchParams({ kind: name }), text: 'Its jobs' }), ' · ',
      el('a', { href: '#/jobs?' + new URLSearchParams({ kind: name, state: 'retry_wait' }), text: 'waiting to retry' }), ' · ',
      el('a', { href: '#/quarantine?' + new URLSearchParams({ kind: name }), text: 'quarantined' }), ' · ',
      el('a', { href: '#/kinds', text: 'all kinds' })),
    el('div', { class: 'columns' },
      el('section', { 'aria-labelledby': 'kind-now' },
        el('h2', { id: 'kind-now', text: 'Now' }),
        el('dl', { class: 'summary', id: 'kind-open' })),
      el('section', { 'aria-labelledby': 'kind-hour' },
        el('h2', { id: 'kind-hour', text: 'Last hour' }),
        el('dl', { class: 'summary', id: 'kind-ended' }))),
    el('section', { 'aria-labelledby': 'kind-minutes' },
      el('h2', { id: 'kind-minutes', text: 'Per minute, last hour' }),
      el('div', { id: 'kind-chart', class: 'minutes' })),
    el('section', { 'aria-labelledby': 'kind-limits' },
      el('h2', { id: 'kind-limits', text: 'Limits' }),
      el('dl', { class: 'summary', id: 'kind-config' })),
  ]);
  const pairs = (id, rows) => {
    const box = document.getElementById(id);
    if (box) box.replaceChildren(...rows.flatMap(([label, key, value]) => [el('dt', { text: label }), el('dd', { [`data-${key}`]: '', text: value })]));
  };
  every(10000, async () => {
    let data;
    try {
      ({ data } = await api('GET', path));
    } catch (e) {
      showError('kind-error', e);
      return e.status !== 404;
    }
    showError('kind-error', null);
    const k = data.kind;
    const state = document.getElementById('kind-state');
    if (!state) return false;
    state.replaceChildren(el('span', { class: `badge ${k.paused ? 'state-quarantined' : 'state-succeeded'}`, 'data-kind-state': k.paused ? 'paused' : 'running', text: k.paused ? `paused${k.paused_by ? ` by ${k.paused_by}` : ''}` : 'running' }),
      ' ', k.paused
        ? el('button', { type: 'button', class: 'small', 'data-needs': 'operate', 'data-resume': k.kind, text: 'Resume',
          onclick: () => act('POST', `${path}/resume`, { requested_by: 'console' }, (d) => `Resumed ${d.kind}: ${count(d.dispatched)} waiting dispatched again.`) })
        : el('button', { type: 'button', class: 'small danger', 'data-needs': 'operate', 'data-pause': k.kind, text: 'Pause',
          onclick: () => act('POST', `${path}/pause`, { requested_by: 'console' }, (d) => `Paused ${d.kind} in every processor.`) }));
    pairs('kind-open', [
      ['Queued', 'queued', count(k.open.queued)], ['of them scheduled', 'scheduled', count(k.open.scheduled)],
      ['Running', 'running', count(k.open.leased)], ['Waiting to retry', 'retry', count(k.open.retry_wait)],
      ['Held by the pause', 'waiting', count(k.waiting)]]);
    const e = k.ended;
    pairs('kind-ended', [
      ['Runs', 'runs', count(e.runs)], ['Succeeded', 'succeeded', count(e.succeeded)],
      ['Failed, retried', 'failed', count(e.failed)], ['Quarantined', 'quarantined', count(e.quarantined)],
      ['Superseded', 'superseded', count(e.superseded)], ['Cancelled', 'cancelled', count(e.cancelled)],
      ['Succeeded / min', 'per-minute', rate(e.succeeded / data.minutes)],
      ['Wait p50 / p99', 'wait', `${bound(e.wait_p50_ms)} / ${bound(e.wait_p99_ms)}`],
      ['Run p50 / p99', 'run', `${bound(e.run_p50_ms)} / ${bound(e.run_p99_ms)}`]]);
    const l = k.limits;
    const t = k.throttle;
    pairs('kind-config', [
      ['Concurrency', 'concurrency', l.concurrency ?? 'the processor\'s'],
      ['Rate (requests / s)', 'rate', l.rate_per_second ?? 'none'],
      ['Quota (cost / min)', 'quota', l.cost_per_minute ?? 'none'],
      ['Throttled', 'throttle', !t || !t.throttles ? 'never'
        : `${t.paused_until ? `paused until ${time(t.paused_until)}; ` : ''}rates at ${Math.round(t.factor * 100)}%; ${count(t.throttles)} times, last ${time(t.throttled_at)}`],
      ['Attempts', 'attempts', count(l.max_attempts)],
      ['Run time-out', 'run-timeout', l.run_timeout_seconds ? age(l.run_timeout_seconds) : 'none']]);
    drawMinutes(document.getElementById('kind-chart'), data.series, data.minutes);
  });
}

/** Bars of succeeded and failed attempts per minute over the last `minutes`, oldest left. */
function drawMinutes(host, series, minutes) {
  if (!host) return;
  const end = Math.floor(Date.now() / 60000);
  const byMinute = new Map(series.map((p) => [Math.floor(new Date(p.minute).getTime() / 60000), p]));
  const width = 600;
  const height = 80;
  const slot = width / minutes;
  const max = Math.max(1, ...series.map((p) => p.succeeded + p.failed + p.quarantined));
  const chart = svg('svg', { viewBox: `0 0 ${width} ${height + 14}`, width, height: height + 14, role: 'img', 'aria-label': `Attempts per minute, last ${minutes} minutes` });
  for (let i = 0; i < minutes; i++) {
    const p = byMinute.get(end - minutes + 1 + i);
    if (!p) continue;
    let y = height;
    for (const [n, cls] of [[p.succeeded, 'bar-ok'], [p.failed + p.quarantined, 'bar-bad']]) {
      const h = (n / max) * (height - 2);
      if (h <= 0) continue;
      y -= h;
      chart.append(svg('rect', { x: (i * slot).toFixed(1), y: y.toFixed(1), width: Math.max(1, slot - 1).toFixed(1), height: h.toFixed(1), class: cls }));
    }
  }
  for (const [x, label, anchor] of [[0, `${minutes} min ago`, 'start'], [width, 'now', 'end']]) {
    const text = svg('text', { x, y: height + 12, 'text-anchor': anchor, class: 'axis' });
    text.textContent = label;
    chart.append(text);
  }
  host.dataset.points = String(series.length);
  host.replaceChildren(chart, el('p', { class: 'note', text: series.length
    ? `${count(series.reduce((n, p) => n + p.succeeded, 0))} succeeded, ${count(series.reduce((n, p) => n + p.failed + p.quarantined, 0))} failed or quarantined; highest minute ${count(max)}.`
    : 'Nothing ran in this hour.' }));
}

// -- Quarantine --

const FILTER_KEYS = ['owner', 'kind', 'reason', 'since', 'until'];

function quarantinePage(params) {
  const filter = {};
  for (const key of FILTER_KEYS) if (params.get(key)) filter[key] = params.get(key);
  append(main(), [
    el('h1', { text: 'Quarantine' }),
    el('p', { class: 'note', text: 'Jobs that stopped for an operator: invalid input, a permanent failure, or a spent budget. Replay runs one again with a fresh budget.' }),
    form('quarantine-filter', [
      ['owner', 'Owner', 'text', filter.owner],
      ['kind', 'Kind', 'text', filter.kind],
      ['reason', 'Reason contains', 'search', filter.reason],
      ['since', 'Since', 'datetime-local', localInput(filter.since)],
      ['until', 'Until', 'datetime-local', localInput(filter.until)],
    ], 'Filter', (data) => { location.hash = '#/quarantine?' + queryOf(data); }),
    el('div', { class: 'actions', id: 'bulk', 'data-needs': 'operate' },
      el('button', { type: 'button', id: 'bulk-count', class: 'secondary', text: 'Replay all that match…', onclick: () => bulkCount(filter) }),
      el('span', { class: 'ask', id: 'bulk-ask', hidden: true })),
    errorLine('quarantine-error'),
    el('h2', { text: 'By reason' }),
    table('Quarantined jobs by owner, kind and reason', ['Owner', 'Kind', 'Class', 'Reason', 'Jobs', 'Latest', ''], 'quarantine-groups'),
    el('h2', { text: 'Jobs' }),
    table('Quarantined jobs', ['Job', 'Kind', 'Document', 'Owner', 'Class', 'Attempts', 'Reason', 'Since', ''], 'quarantined'),
  ]);
  const groupQuery = new URLSearchParams(filter);
  groupQuery.set('limit', '50');
  api('GET', '/v1/quarantine/groups?' + groupQuery).then(({ data }) => {
    const body = document.getElementById('quarantine-groups');
    if (!data.length) body.append(el('tr', {}, el('td', { colspan: 7, class: 'empty', text: 'Nothing quarantined matches.' })));
    data.forEach((g, i) => {
      body.append(el('tr', { 'data-group': i, 'data-group-jobs': g.jobs },
        el('td', { text: g.owner }),
        el('td', { text: g.kind }),
        el('td', { text: g.error_class }),
        el('td', { class: 'error-text', text: g.reason }),
        el('td', { class: 'num', text: count(g.jobs) }),
        el('td', { class: 'time', text: time(g.last) }),
        el('td', {}, el('button', { type: 'button', class: 'small', 'data-needs': 'operate', 'data-replay-group': i, text: 'Replay this group…',
          // Counted first (a dry run of the same filter), then confirmed, as any bulk replay.
          onclick: () => bulkCount({ ...filter, owner: g.owner, kind: g.kind, reason: g.reason }) }))));
    });
  }).catch((e) => showError('quarantine-error', e));
  const query = new URLSearchParams(filter);
  query.set('limit', '200');
  api('GET', '/v1/quarantine?' + query).then(({ data }) => {
    const body = document.getElementById('quarantined');
    if (!data.length) body.append(el('tr', {}, el('td', { colspan: 9, class: 'empty', text: 'Nothing quarantined matches.' })));
    for (const q of data) {
      body.append(el('tr', { 'data-job': q.job_id },
        el('td', { class: 'mono' }, el('a', { href: `#/jobs/${q.job_id}`, text: q.job_id })),
        el('td', { text: q.kind }),
        el('td', {}, el('span', { class: 'doc', text: q.document_id })),
        el('td', { text: q.owner }),
        el('td', { text: q.error_class }),
        el('td', { class: 'num', text: q.attempts }),
        el('td', { class: 'error-text', text: q.reason }),
        el('td', { class: 'time', text: time(q.quarantined_at) }),
        el('td', {}, el('button', { type: 'button', class: 'small', 'data-needs': 'operate', 'data-replay': q.job_id, text: 'Replay',
          onclick: () => act('POST', `/v1/jobs/${q.job_id}/replay`, {}, 'Replayed: it runs again with a fresh budget.') }))));
    }
  }).catch((e) => showError('quarantine-error', e));
}

async function bulkCount(filter) {
  const ask = document.getElementById('bulk-ask');
  let counted;
  try {
    ({ data: counted } = await api('POST', '/v1/quarantine/replay', { ...filter, dry_run: true }));
  } catch (e) {
    toast(`Refused: ${e.message}${e.status ? ` (${e.status})` : ''}`, 'error');
    return;
  }
  const described = Object.keys(filter).length ? 'match this filter' : 'are quarantined (no filter)';
  ask.replaceChildren(
    el('span', { id: 'bulk-matched', 'data-matched': counted.matched, text: `${count(counted.matched)} jobs ${described}. Replay them all?` }),
    counted.matched ? el('button', { type: 'button', id: 'bulk-yes', class: 'danger', text: `Replay ${count(counted.matched)} jobs`,
      onclick: () => act('POST', '/v1/quarantine/replay', { ...filter, requested_by: 'console' },
        (d) => `Replayed ${count(d.replayed)} of ${count(d.matched)} in ${d.batches} ${d.batches === 1 ? 'batch' : 'batches'}${d.remaining ? `; ${count(d.remaining)} remain: replay again` : ''}.`) }) : null,
    el('button', { type: 'button', class: 'secondary', text: 'Never mind', onclick: () => { ask.hidden = true; } }));
  ask.hidden = false;
  (ask.querySelector('#bulk-yes') || ask.querySelector('button')).focus();
}

// -- Dead letters --

/** Deletes the dead letters listed (this topic's, or all), counted first. */
function bulkDeleteBar(params) {
  const query = new URLSearchParams();
  if (params.get('topic')) query.set('topic', params.get('topic'));
  const ask = el('span', { class: 'ask', id: 'delete-ask', hidden: true });
  const countMatching = async () => {
    let counted;
    try {
      ({ data: counted } = await api('DELETE', `/v1/dead-letters?${query}&dry_run=true`));
    } catch (e) {
      toast(`Refused: ${e.message}${e.status ? ` (${e.status})` : ''}`, 'error');
      return;
    }
    const what = params.get('topic') ? `on ${params.get('topic')}` : 'in all';
    ask.replaceChildren(
      el('span', { id: 'delete-matched', 'data-matched': counted.matched, text: `${count(counted.matched)} dead letters ${what}. Delete them for good?` }),
      counted.matched ? el('button', { type: 'button', id: 'delete-all-yes', class: 'danger', text: `Delete ${count(counted.matched)}`,
        onclick: () => act('DELETE', `/v1/dead-letters?${query}`, undefined, (d) => `Deleted ${count(d.deleted)} dead letters.`) }) : null,
      el('button', { type: 'button', class: 'secondary', text: 'Never mind', onclick: () => { ask.hidden = true; } }));
    ask.hidden = false;
    (ask.querySelector('#delete-all-yes') || ask.querySelector('button')).focus();
  };
  return el('div', { class: 'actions', 'data-needs': 'admin' },
    el('button', { type: 'button', id: 'delete-count', class: 'secondary', text: 'Delete all listed…', onclick: countMatching }),
    ask);
}

function deadLettersPage(params) {
  append(main(), [
    el('h1', { text: 'Dead letters' }),
    el('p', { class: 'note', text: 'Messages the intake or a processor could not decode, kept with their Kafka coordinates. Re-inject one once its cause is fixed.' }),
    bulkDeleteBar(params),
    errorLine('dead-letters-error'),
    table('Dead letters', ['Id', 'Topic', 'Partition', 'Offset', 'Group', 'Error', 'Received', 'Re-injected'], 'dead-letters'),
    el('button', { type: 'button', id: 'dead-letters-more', class: 'secondary', hidden: true, text: 'Next page' }),
  ]);
  const body = document.getElementById('dead-letters');
  const more = document.getElementById('dead-letters-more');
  const load = async (after) => {
    const query = new URLSearchParams({ limit: '50' });
    if (params.get('topic')) query.set('topic', params.get('topic'));
    if (after) query.set('after', after);
    try {
      const { data } = await api('GET', '/v1/dead-letters?' + query);
      if (!after && !data.dead_letters.length) body.append(el('tr', {}, el('td', { colspan: 8, class: 'empty', text: 'No dead letters.' })));
      for (const d of data.dead_letters) {
        body.append(el('tr', { 'data-dead-letter': d.id },
          el('td', { class: 'num' }, el('a', { href: `#/dead-letters/${d.id}`, text: d.id })),
          el('td', { text: d.topic }), el('td', { class: 'num', text: d.kafka_partition }),
          el('td', { class: 'num', text: d.kafka_offset }), el('td', { text: d.consumer_group }),
          el('td', { class: 'error-text', text: d.error }), el('td', { class: 'time', text: time(d.received_at) }),
          el('td', { class: 'num', text: d.reinjected_count })));
      }
      more.hidden = !data.next;
      more.onclick = () => load(data.next);
    } catch (e) {
      showError('dead-letters-error', e);
    }
  };
  load(null);
}

function deadLetterPage(id) {
  append(main(), [el('h1', {}, 'Dead letter ', el('span', { class: 'mono', text: id })), errorLine('dead-letter-error')]);
  api('GET', `/v1/dead-letters/${encodeURIComponent(id)}`).then(({ data }) => {
    const d = data.letter || data;
    const rows = [
      ['Topic', d.topic], ['Partition', d.kafka_partition], ['Offset', d.kafka_offset],
      ['Consumer group', d.consumer_group], ['Received', time(d.received_at)],
      ['Error', el('span', { class: 'error-text', text: d.error })],
      ['Re-injected', d.reinjected_count ? `${d.reinjected_count} times, last ${time(d.reinjected_at)}` : 'never'],
    ];
    const bytes = (label, text, hex) => el('section', {},
      el('h2', { text: label }),
      el('pre', { tabindex: 0, 'data-field': `${label.toLowerCase()}_text`, text: text === null || text === undefined ? '(none)' : clip(text) }),
      el('details', {}, el('summary', { text: 'As hex' }), el('pre', { tabindex: 0, text: hex ? clip(hex) : '(none)' })));
    append(main(), [
      el('div', { class: 'actions' },
        el('button', { type: 'button', id: 'reinject', 'data-needs': 'operate', text: 'Re-inject', onclick: () => act('POST', `/v1/dead-letters/${d.id}/reinject`, undefined,
          (r) => `Sent back to ${r.topic} (partition ${r.partition}, offset ${r.offset}).`) }),
        confirmButton('delete', 'admin', 'Delete', 'Delete this dead letter for good?', 'Yes, delete it',
          () => act('DELETE', `/v1/dead-letters/${d.id}`, undefined, 'Deleted.', () => { location.hash = '#/dead-letters'; }))),
      el('dl', { class: 'summary' }, rows.flatMap(([term, value]) => [el('dt', { text: term }), el('dd', {}, value instanceof Node ? value : String(value))])),
      el('div', { class: 'columns' }, bytes('Key', data.key_text, data.key_hex), bytes('Value', data.value_text, data.value_hex)),
    ]);
  }).catch((e) => showError('dead-letter-error', e));
}

// -- Processors --

const PROCESSORS_EVERY_MS = 3000;

/** "3.2 s ago", "4 min 10 s ago" beside an absolute time. */
function ago(seconds) {
  return `${age(seconds)} ago`;
}

function processorsPage() {
  append(main(), [
    el('h1', { text: 'Processors' }),
    el('p', { class: 'note', text: 'Each processor writes what it holds and runs every 3 s; one not seen for 9 s has probably stopped without a word (its jobs come back when their leases run out).' }),
    errorLine('processors-error'),
    el('div', { id: 'processors' }),
  ]);
  every(PROCESSORS_EVERY_MS, async () => {
    try {
      const { data } = await api('GET', '/v1/processors');
      renderProcessors(data.processors);
      showError('processors-error', null);
    } catch (e) {
      showError('processors-error', e);
    }
  });
}

function renderProcessors(processors) {
  const box = document.getElementById('processors');
  if (!box) return;
  if (!processors.length) {
    box.replaceChildren(el('p', { class: 'empty', text: 'No processor is running.' }));
    return;
  }
  const now = Date.now();
  box.replaceChildren(...processors.map((p) => el('section', { class: 'processor', 'data-processor': p.owner, 'data-alive': p.alive ? 'yes' : 'no' },
    el('h2', {}, el('span', { class: 'mono', text: p.owner }), ' ',
      el('span', { class: `badge ${p.alive ? 'state-succeeded' : 'state-quarantined'}`, text: p.alive ? 'running' : 'not seen' })),
    el('dl', { class: 'summary' },
      el('dt', { text: 'Group' }), el('dd', { class: 'mono', text: p.group }),
      el('dt', { text: 'Version' }), el('dd', { text: p.version }),
      el('dt', { text: 'Since' }), el('dd', { text: `${time(p.started_at)} (${ago((now - new Date(p.started_at).getTime()) / 1000)})` }),
      el('dt', { text: 'Last seen' }), el('dd', { 'data-seen': p.seen_ago_seconds, text: ago(p.seen_ago_seconds) }),
      el('dt', { text: 'Partitions' }), el('dd', { 'data-partitions': p.partitions.join(','), text: p.partitions.length ? p.partitions.join(', ') : 'none' }),
      el('dt', { text: 'Running' }), el('dd', { 'data-in-flight': p.in_flight, text: count(p.in_flight) })),
    p.running.length ? el('div', { class: 'scroll' }, el('table', { 'aria-label': `Jobs running in ${p.owner}` },
      el('thead', {}, el('tr', {}, ['Job', 'Kind', 'Document', 'Generation', 'Running for'].map((c, i) => el('th', { scope: 'col', class: i >= 3 ? 'num' : null, text: c })))),
      el('tbody', {}, p.running.map((j) => el('tr', { 'data-running': j.job_id },
        el('td', { class: 'mono' }, el('a', { href: `#/jobs/${j.job_id}`, text: j.job_id })),
        el('td', { text: j.kind }),
        el('td', {}, el('span', { class: 'doc', text: j.document_id })),
        el('td', { class: 'num', text: j.generation }),
        el('td', { class: 'num', title: time(j.started_at), text: age(Math.max(0, now - new Date(j.started_at).getTime()) / 1000) })))))) : null,
    p.in_flight > p.running.length ? el('p', { class: 'note', text: `…and ${count(p.in_flight - p.running.length)} more.` }) : null)));
}

// -- Audit --

function auditPage(params) {
  const before = params.get('before');
  append(main(), [
    el('h1', { text: 'Audit trail' }),
    el('p', { class: 'note', text: 'Every change made through the API, this console or the CLI: who, with which role, what, when. Newest first.' }),
    errorLine('audit-error'),
    table('Audit trail', ['At', 'Actor', 'Role', 'Via', 'Action', 'Target', 'Request'], 'audit'),
    el('a', { id: 'audit-more', class: 'button secondary', hidden: true, text: 'Older' }),
  ]);
  const query = new URLSearchParams({ limit: '100' });
  if (before) query.set('before', before);
  api('GET', '/v1/audit?' + query).then(({ data }) => {
    const body = document.getElementById('audit');
    if (!data.entries.length) body.append(el('tr', {}, el('td', { colspan: 7, class: 'empty', text: 'No changes recorded.' })));
    for (const e of data.entries) {
      const target = e.target && UUID.test(e.target)
        ? el('a', { href: `#/jobs/${e.target}`, class: 'mono', text: e.target })
        : el('span', { text: e.target || '–' });
      body.append(el('tr', { 'data-audit-action': e.action, 'data-audit-actor': e.actor },
        el('td', { class: 'time', text: time(e.at) }),
        el('td', { text: e.actor }),
        el('td', { text: e.role || '–' }),
        el('td', { text: e.via }),
        el('td', { text: e.action }),
        el('td', {}, target),
        el('td', { class: 'mono', text: e.request_id || '–' })));
    }
    const more = document.getElementById('audit-more');
    if (data.next) {
      more.href = `#/audit?before=${data.next}`;
      more.hidden = false;
    }
  }).catch((e) => showError('audit-error', e));
}

function clip(text) {
  return text.length > PREVIEW_CHARS ? `${text.slice(0, PREVIEW_CHARS)}\n… (${count(text.length)} characters in all)` : text;
}

// ---- Start -------------------------------------------------------------------------------

function start() {
  document.getElementById('login-form').addEventListener('submit', signIn);
  document.getElementById('login-cancel').addEventListener('click', hideLogin);
  document.getElementById('sign-in-open').addEventListener('click', () => showLogin());
  document.getElementById('sign-out').addEventListener('click', () => {
    signOut();
    renderSession();
    toast('Signed out.');
    route();
  });
  window.addEventListener('hashchange', () => { route(); main().focus({ preventScroll: true }); });
  api('GET', '/v1/overview').then(({ data }) => {
    app.tokenRequired = data.token_required;
    app.traceUrl = data.trace_url || null;
    renderSession();
  }).catch(() => renderSession());
  route();
}

document.addEventListener('DOMContentLoaded', start);
